"""The ODC optimizer step that both trainers run, the one meeting of the ranks after it, and the logs.

A Hugging Face ``Trainer`` calls ``training_step`` once per microbatch and lets Accelerate decide when to step. Under
ODC + LB-Mini one optimizer step has a different microbatch count on every rank (0 included), so the trainers run a
whole step from one ``training_step`` call through :meth:`OdcStep._odc_train_step`: gradient sync off for every
microbatch (ODC pushes each microbatch's gradients as its backward produces them), then one DeepSpeed step at an
explicit accumulation boundary, on every rank. That step is where ranks meet; :meth:`OdcStep._odc_meet` then gathers,
in one collective, every rank's timings (busy time, microbatches, tokens) together with whatever else the trainer must
combine across ranks (TRL's per-token metrics), feeds the automatic cost, and records the balance metrics that
:meth:`OdcStep.log` adds to each training log line.

Busy time is :mod:`ds_odc.training.metrics`' definition: the step's wall time less the wait at ODC's fence.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from ds_odc.integrations._hf_privates import set_sync_gradients
from ds_odc.integrations._metrics import BalanceMeter
from ds_odc.training.metrics import StepClock, StepRecord, record_from_rows

__all__ = ["OdcStep", "StepTimes", "BALANCER_STATE_NAME", "resolve_checkpoint", "save_balancer_state",
           "load_balancer_state"]

BALANCER_STATE_NAME = "ds_odc_balancer.json"  # in every checkpoint folder: where the balancer stands


@dataclass(frozen=True)
class StepTimes:
    """This rank's share of one optimizer step: summed loss of its microbatches, and its timings."""

    loss: torch.Tensor
    busy_s: float
    step_s: float
    microbatches: int


class OdcStep:
    """Mixed into a ``Trainer`` subclass (before the ``Trainer`` class) that sets ``self.odc`` and, with ODC on,
    ``self.odc_meter``. Subclasses may override :meth:`_odc_observe_cost` to feed their automatic cost."""

    odc: bool
    odc_meter: BalanceMeter | None

    def _odc_train_step(self, microbatches: Iterable[Any], train_one: Callable[[Any], torch.Tensor]) -> StepTimes:
        """Run ``train_one`` (forward and backward of one microbatch, returning its detached loss) on every
        microbatch, then the optimizer step that every rank takes whatever its count."""
        engine = self.model_wrapped  # the DeepSpeedEngine
        clock = StepClock()
        clock.start()
        total = torch.zeros((), device=self.args.device)
        count = 0
        for mb in microbatches:
            set_sync_gradients(self.accelerator, False)
            total = total + train_one(mb)
            count += 1
        set_sync_gradients(self.accelerator, True)
        engine.set_gradient_accumulation_boundary(True)
        engine.step()
        busy, step_time = clock.finish(float(getattr(engine.optimizer, "odc_wait_s", 0.0)))
        return StepTimes(total, busy, step_time, count)

    def _odc_meet(self, times: StepTimes, tokens: int, sq_tokens: float, num_samples: int, payload: Any = None,
                  generation: tuple[float, int] = (0.0, 0)) -> list[Any]:
        """After the step, where every rank is: one all-gather of every rank's numbers and ``payload``; the same
        :class:`StepRecord` on every rank feeds the automatic cost and the balance metrics. ``generation``: this
        rank's generation seconds and new tokens since the last step. Returns every rank's ``payload``, in rank
        order."""
        mine = ([0.0, times.busy_s, times.step_s, float(times.microbatches), float(tokens), float(sq_tokens)],
                [float(generation[0]), int(generation[1])], payload)
        ranks = [mine] if not dist.is_initialized() else [None] * dist.get_world_size()
        if dist.is_initialized():
            dist.all_gather_object(ranks, mine)
        record = record_from_rows([r[0] for r in ranks], num_samples)
        update = self._odc_observe_cost(record)
        if update is not None:
            record.cost = update.as_dict()
        self.odc_meter.add(record, generation=(max(r[1][0] for r in ranks), sum(r[1][1] for r in ranks))
                           if any(r[1][0] > 0 for r in ranks) else None)
        return [r[2] for r in ranks]

    def _odc_observe_cost(self, record: StepRecord):
        """Feed the step's per-rank numbers to the automatic cost; returns its update (or None)."""
        return None

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if self.odc and self.odc_meter is not None and "loss" in logs:
            logs.update(self.odc_meter.summary())
            self.odc_meter.reset()
        super().log(logs, *args, **kwargs)


def resolve_checkpoint(output_dir: str, resume) -> str | None:
    """``resume_from_checkpoint`` as the Trainer reads it: ``True`` = the last checkpoint in ``output_dir``."""
    if isinstance(resume, bool):
        if not resume:
            return None
        from transformers.trainer_utils import get_last_checkpoint
        found = get_last_checkpoint(output_dir)
        if found is None:
            raise ValueError(f"No valid checkpoint found in output directory ({output_dir})")
        return found
    return resume or None


def save_balancer_state(folder: str, state: dict) -> None:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, BALANCER_STATE_NAME), "w") as f:
        json.dump(state, f, indent=1)


def load_balancer_state(folder: str) -> dict | None:
    path = os.path.join(folder, BALANCER_STATE_NAME)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)
