"""One rank of test_step_visits.py: OdcTrainer's ODC steps, followed file by file between the trainer's file and the
runner's, under ``sys.setprofile``.

Usage: step_visits_worker.py; prints one ODC_RESULT line: per step, this rank's microbatches and the step's *visits*.
A visit starts whenever the innermost frame of the two files is in the other one than before: a call into a file, or
a return back into it. Frames of every other file (Hugging Face, torch, DeepSpeed, ds_odc's helpers) are
transparent. Then the same once more with a planted call from the runner back up into the trainer in every
microbatch, which the test must see.
"""

from __future__ import annotations

import os
import sys

import ds_odc  # noqa: F401  (the `odc` key must parse before any TrainingArguments)
from _support.launch import emit
from ds_odc.training.distributed import shutdown_and_exit

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "zero"))
from worker import init_ranks  # noqa: E402
from _hf_workload import shared_tmpdir, tiny_llama, token_dataset, training_args  # noqa: E402


def follow(files: dict[str, str]):
    """A profile function and the visits it records: ``(label, function, how)`` each time the innermost frame of
    ``files`` (path -> label) changes to one of the other file; ``how`` is ``"call"`` or ``"return"``. Frames below
    the one that installs it are left out (the Trainer's loop runs inside a trainer method too)."""
    visits: list[tuple[str, str, str]] = []
    stack: list = []  # per frame entered since: (label, function) of the innermost frame of ``files``, or None
    state = {"now": None, "floor": sys._getframe(1)}

    def innermost(frame):
        while frame is not None and frame is not state["floor"]:
            label = files.get(frame.f_code.co_filename)
            if label is not None:
                return label, frame.f_code.co_qualname
            frame = frame.f_back
        return None

    def profile(frame, event, arg):
        if event == "call":
            label = files.get(frame.f_code.co_filename)
            here = (label, frame.f_code.co_qualname) if label else (stack[-1] if stack else innermost(frame.f_back))
            stack.append(here)
            how = "call"
        elif event == "return":
            if stack:
                stack.pop()
            here = stack[-1] if stack else innermost(frame.f_back)
            how = "return"
        else:
            return
        if here is not None and (state["now"] is None or here[0] != state["now"][0]):
            visits.append((here[0], here[1], how))
        state["now"] = here

    return profile, visits


def run(tmp: str, steps: int, plant: bool) -> list[dict]:
    from ds_odc.integrations import _runner, transformers as odc_transformers
    from ds_odc.integrations.transformers import OdcTrainer

    files = {os.path.abspath(_runner.__file__): "runner", os.path.abspath(odc_transformers.__file__): "trainer"}
    recorded: list[dict] = []

    class Followed(OdcTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            profile, visits = follow(files)
            sys.setprofile(profile)
            try:
                return super().training_step(model, inputs, num_items_in_batch)
            finally:
                sys.setprofile(None)
                recorded.append({"microbatches": len(inputs.microbatches), "visits": visits})

    stock_forward_backward = _runner.OdcRunner.forward_backward

    def asks_the_trainer_first(self, model, mb):  # planted: a call back up into the trainer in every microbatch
        self.trainer.odc_collator()
        return stock_forward_backward(self, model, mb)

    if plant:
        _runner.OdcRunner.forward_backward = asks_the_trainer_first
    try:
        args = training_args(tmp, odc=True, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                             max_steps=steps, logging_steps=steps)
        Followed(tiny_llama(), args, train_dataset=token_dataset(4 * steps), max_tokens_per_microbatch=48,
                 balancer_cost="tokens").train()
    finally:
        _runner.OdcRunner.forward_backward = stock_forward_backward
    return recorded


def main():
    init_ranks(timeout_s=60)
    with shared_tmpdir("odc_visits_") as tmp:
        emit({"steps": run(f"{tmp}/odc", steps=2, plant=False), "planted": run(f"{tmp}/planted", steps=1, plant=True)})
    shutdown_and_exit()


if __name__ == "__main__":
    main()
