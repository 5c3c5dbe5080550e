"""Per-step throughput and idle-time accounting, the same in every mode (stock ZeRO-3 or ODC).

Each rank measures ``busy_s`` (its forward/backward work plus the optimizer update) and the step's wall time; rank
results are gathered once per step, at the step, where every rank is anyway. The bubble rate is
``1 - sum(busy) / (R * step_time)``: the share of device time spent waiting at synchronization points.

With ODC the only waiting is the fence, which the optimizer times, so busy is exact. Under collectives the waits
hide inside every layer's all-gather and reduce-scatter and are counted as busy, so for stock ZeRO-3 the reported
bubble is a lower bound (the simulator's collective model gives the compute-only figure).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Iterable

import torch


def device_sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


@dataclass
class RankStep:
    busy_s: float
    wait_s: float
    microbatches: int
    tokens: int
    sq_tokens: int = 0  # sum over this rank's samples of length^2 (attention's share of the cost; for the cost fit)


@dataclass
class StepRecord:
    loss: float
    samples_per_s: float
    tokens_per_s: float
    bubble_rate: float
    step_time_s: float
    peak_mem_bytes: int
    per_rank: list[RankStep] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


class StepClock:
    """Times one optimizer step on this rank: call ``start()``, then ``compute_done()`` after the last microbatch,
    then ``finish(...)`` after ``engine.step()``."""

    def start(self) -> None:
        device_sync()
        self.t0 = time.perf_counter()

    def compute_done(self) -> None:
        device_sync()
        self.t_compute = time.perf_counter()

    def finish(self, fence_wait_s: float = 0.0) -> tuple[float, float]:
        """Returns (busy_s, step_time_s) of this rank. ``fence_wait_s``: time the step spent waiting for peers."""
        device_sync()
        step_time = time.perf_counter() - self.t0
        return step_time - fence_wait_s, step_time


def gather_step(loss_sum: float, busy_s: float, step_time_s: float, microbatches: int, tokens: int,
                num_samples: int, group=None, sq_tokens: int = 0) -> StepRecord:
    """Collect every rank's numbers (one small collective) and derive the step's record. ``loss_sum`` is this
    rank's share of the global mean loss (the shares add up to it)."""
    import torch.distributed as dist
    mine = [loss_sum, busy_s, step_time_s, float(microbatches), float(tokens), float(sq_tokens)]
    world = dist.get_world_size(group)
    rows = [None] * world
    dist.all_gather_object(rows, mine, group=group)
    step_time = max(r[2] for r in rows)
    busy = [min(r[1], step_time) for r in rows]
    total_tokens = sum(int(r[4]) for r in rows)
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() and torch.cuda.is_initialized() else 0
    return StepRecord(
        loss=sum(r[0] for r in rows),
        samples_per_s=num_samples / step_time,
        tokens_per_s=total_tokens / step_time,
        bubble_rate=1.0 - sum(busy) / (world * step_time),
        step_time_s=step_time,
        peak_mem_bytes=int(peak),
        per_rank=[RankStep(b, step_time - b, int(r[3]), int(r[4]), int(r[5])) for b, r in zip(busy, rows)],
    )


def summarize(records: list[StepRecord], warmup_steps: int, world_size: int, untimed: Iterable[int] = ()) -> dict:
    """Throughput and bubble over the timed steps (after ``warmup_steps``, less the ``untimed`` step indices, e.g. a
    profiled one), weighting each step by its time."""
    skip = set(untimed)
    timed = [r for i, r in enumerate(records) if i >= warmup_steps and i not in skip] or records
    total = sum(r.step_time_s for r in timed)
    samples_per_s = sum(r.samples_per_s * r.step_time_s for r in timed) / total
    return {
        "samples_per_s": samples_per_s,
        "samples_per_s_per_device": samples_per_s / world_size,
        "tokens_per_s": sum(r.tokens_per_s * r.step_time_s for r in timed) / total,
        "bubble_rate": 1.0 - sum(sum(p.busy_s for p in r.per_rank) for r in timed) / (world_size * total),
        "time_s": total,
        "peak_mem_bytes": max(r.peak_mem_bytes for r in records),
        "final_loss": records[-1].loss,
    }
