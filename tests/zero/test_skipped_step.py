"""A rank with no microbatch that forgets ``engine.step()`` (the README loop's ``k == 0`` rule), at 3 CPU ranks.

Tagged (``ds_odc.tag_minibatch``), the step's meeting compares the minibatch every rank is on: every rank must fail at
that step, naming the rank, well before the fence's timeout, instead of one update silently mixing two minibatches.
Untagged, the run can only fail at its end, when the rank that took fewer steps has finished: the timeout's error
must then say that rank has finished. And a loop that tags correctly trains exactly as one that does not.
"""

from pathlib import Path

import pytest

from _support.launch import launch

WORKER = Path(__file__).with_name("worker.py")
pytestmark = pytest.mark.slow
TIMEOUT_S = 30  # the fence's timeout_s in the tagged runs: the error must come long before it


@pytest.mark.parametrize("managed", [False, True])
def test_a_skipped_step_fails_at_that_step_naming_the_rank(managed):
    args = ["skipped_step", "--counts", "2,1,0", "--victim", 2, "--steps", 4, "--tag", "--timeout", TIMEOUT_S]
    r = launch(WORKER, 3, args + (["--managed"] if managed else []), timeout=180, launcher="plain")
    by_rank = {x["rank"]: x for x in r.results}
    assert sorted(by_rank) == [0, 1, 2], r.stdout[-3000:] + r.stderr[-6000:]
    for rank, report in by_rank.items():
        assert report["error_type"] == "MinibatchMismatch" and report["ranks"] == [2], report
        assert report["step"] == (2 if rank == 2 else 1), report  # the others at the skipped step, rank 2 one later
        assert report["after_s"] < TIMEOUT_S / 3, report  # measured 0.1 s
        error = report["error"]
        assert "rank 2: epoch 0, step 2" in error and "ranks 0, 1: epoch 0, step 1" in error, error
        assert "Rank 2 went past" in error and "engine.step()" in error and "k == 0" in error, error


@pytest.mark.parametrize("finish", ["shutdown", "destroy"])
def test_untagged_the_timeout_says_the_missing_rank_has_finished(finish):
    args = ["skipped_step", "--counts", "2,1,0", "--victim", 2, "--steps", 4, "--timeout", 8]
    r = launch(WORKER, 3, args + (["--destroy"] if finish == "destroy" else []), timeout=180, launcher="plain")
    by_rank = {x["rank"]: x for x in r.results}
    assert by_rank[2] == {"rank": 2, "error_type": None, "steps": 4}, by_rank  # it believes it trained 4 minibatches
    why = "reached shutdown()" if finish == "shutdown" else "destroyed its engine"
    for rank in (0, 1):
        report = by_rank[rank]
        assert report["error_type"] == "FenceTimeout" and report["ranks"] == [2] and report["step"] == 3, report
        assert f"rank 2 will not come: it has finished ({why})" in report["error"], report["error"]
        assert "engine.step()" in report["error"] and "k == 0" in report["error"], report["error"]


def test_a_tagged_loop_trains_as_an_untagged_one():
    """The control: every rank tags correctly (one of them has no microbatch), and the result equals the
    single-process reference as the untagged loop's does."""
    r = launch(WORKER, 3, ["uneven", "--counts", "2,1,0", "--tag"], timeout=240).check().result
    assert r["optimizer"] == "OdcOptimizer"
    assert r["max_rel_diff"] < 1e-5, r  # measured 1e-8 .. 2e-7 untagged
