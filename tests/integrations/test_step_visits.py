"""One OdcTrainer step read in one place: followed from ``training_step`` down, it enters the runner's file
(``_runner.py``) once, and comes back to the trainer's file (``transformers.py``) only for the trainer's hooks: once
for ``odc_prepare_step``, once per microbatch for ``odc_loss``, and once more when the step returns. Every other step
of the loop (the microbatch context, the optimizer step, the meeting, ``odc_step_metrics``'s default) stays in the
runner's file.

One CPU rank, the tiny Llama, two steps (3 and 4 microbatches) under ``sys.setprofile``
(``step_visits_worker.py``; frames of every other file are transparent), then one step with a planted call from the
runner back up into the trainer in every microbatch, which the same check must refuse.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from _support.launch import launch

WORKER = Path(__file__).with_name("step_visits_worker.py")


def story(microbatches: int) -> list[tuple[str, str, str]]:
    """The visits of one step: (file, function entered or returned into, how)."""
    return ([("trainer", "OdcTrainer.training_step", "call"), ("runner", "OdcRunner.run", "call"),
             ("trainer", "OdcTrainer.odc_prepare_step", "call"), ("runner", "OdcRunner.run", "return")]
            + [("trainer", "OdcTrainer.odc_loss", "call"), ("runner", "OdcRunner.forward_backward", "return")]
            * microbatches
            + [("trainer", "PackRunner.train", "return")])


def departures(step: dict) -> list[str]:
    """What a step does beyond :func:`story`: the calls into each file that the story does not make."""
    visits = [tuple(v) for v in step["visits"]]
    expected = Counter(v for v in story(step["microbatches"]) if v[2] == "call")
    found = Counter(v for v in visits if v[2] == "call")
    return [f"{n} x {file}:{function}" for (file, function, _), n in sorted((found - expected).items())]


@pytest.fixture(scope="module")
def followed():
    return launch(WORKER, 1, timeout=180, launcher="plain").check().result


def test_a_step_enters_each_file_once_and_the_trainer_once_per_microbatch(followed):
    steps = followed["steps"]
    assert len(steps) == 2 and max(s["microbatches"] for s in steps) > 1, steps  # a loop to follow
    for step in steps:
        visits = [tuple(v) for v in step["visits"]]
        n = step["microbatches"]
        files = Counter(file for file, _, _ in visits)
        assert visits == story(n), (f"a step of {n} microbatches visits the trainer's file {files['trainer']} times "
                                    f"and the runner's {files['runner']} times (expected {3 + n} and {2 + n}); "
                                    f"calls beyond the story: {departures(step)}; visits: {visits}")


def test_the_check_sees_a_planted_call_back_into_the_trainer(followed):
    (step,) = followed["planted"]
    n = step["microbatches"]
    assert [tuple(v) for v in step["visits"]] != story(n)
    assert departures(step) == [f"{n} x trainer:OdcTrainer.odc_collator"]
