"""One short line per logging step on the console, in place of the whole log dict.

With the progress bar off (``disable_tqdm=True``) the Hugging Face Trainer prints every log dict whole
(``PrinterCallback``): with ODC's ``odc/*`` balance metrics and TRL's own that is about 1,000 characters a step.
:class:`LogLines` prints the numbers to watch instead::

    step 3/10  loss 6.9213  grad_norm 0.513  lr 1.00e-04  samples/s 12.4  odc wait 0.004 s/step (bubble 12.3%)

``show_log_lines(trainer)`` swaps it in (``extra``: more keys to show, such as TRL's ``reward``). Nothing is lost:
every value is still in ``trainer.state.log_history`` and goes to the trainer's ``report_to`` integrations.
"""

from __future__ import annotations

from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback

__all__ = ["LogLines", "show_log_lines"]

_SUMMARY = "train_runtime"  # the Trainer's last log: totals of the whole run


class LogLines(TrainerCallback):
    """Prints each log of the Trainer as one line on the main process (see the module docstring)."""

    def __init__(self, extra: tuple[str, ...] = ()) -> None:
        self.extra = tuple(extra)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            print(log_line(logs, state.global_step, state.max_steps, self.extra), flush=True)


def show_log_lines(trainer, extra: tuple[str, ...] = ()) -> None:
    """Print :class:`LogLines` instead of the Trainer's whole log dicts (``PrinterCallback``, which it adds when the
    progress bar is off)."""
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(LogLines(extra))


def log_line(logs: dict, step: int, max_steps: int, extra: tuple[str, ...] = ()) -> str:
    """The line for one log dict: a training step's, the run's summary, or any other (evaluation, ...)."""
    if _SUMMARY in logs:
        parts = [f"train: {step} steps in {logs[_SUMMARY]:.1f} s"]
        if "train_samples_per_second" in logs:
            parts.append(f"samples/s {logs['train_samples_per_second']:.3g}")
        if "train_loss" in logs:
            parts.append(f"mean loss {logs['train_loss']:.4f}")
        return "  ".join(parts)
    if "loss" not in logs:
        return f"step {step}  " + "  ".join(f"{k} {_number(v)}" for k, v in logs.items())
    parts = [f"step {step}/{max_steps}" if max_steps > 0 else f"step {step}", f"loss {logs['loss']:.4f}"]
    if "grad_norm" in logs:
        parts.append(f"grad_norm {_number(logs['grad_norm'])}")
    if "learning_rate" in logs:
        parts.append(f"lr {logs['learning_rate']:.2e}")
    parts += [f"{key} {_number(logs[key])}" for key in extra if key in logs]
    if "odc/samples_per_second" in logs:
        parts.append(f"samples/s {logs['odc/samples_per_second']:.3g}")
    if "odc/step_wait_seconds" in logs:
        parts.append(f"odc wait {logs['odc/step_wait_seconds']:.3f} s/step"
                     + (f" (bubble {logs['odc/bubble']:.1%})" if "odc/bubble" in logs else ""))
    return "  ".join(parts)


def _number(value) -> str:
    return f"{value:#.4g}" if isinstance(value, float) else str(value)
