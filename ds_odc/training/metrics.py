"""Per-step throughput and idle-time accounting: one definition for every front end and every mode.

**Busy time** of a rank in one optimizer step: the wall time from the step's first microbatch to the end of its
optimizer update, less the time it spent waiting for other ranks (ODC's fence and barrier, which the ODC optimizer
times: ``ds_odc.zero.engine.wait_seconds(engine)``). **Step time**: the slowest rank's wall time. Rank numbers are gathered once
per step, at the step, where every rank is anyway (:func:`gather_step`), and

    bubble = 1 - sum_r busy_r / (R * step_time)

is the share of device time spent waiting; over several steps (a summary, a logging window) the sums run over the
steps too, so the rate is time-weighted. ``examples/sft.py``, the FSDP2 baseline (``benchmarks/fsdp2_sft.py``) and
``OdcTrainer``'s ``odc/*`` logs all use these functions.

With ODC the only waiting is at the fence, so busy is exact. Under collectives (stock ZeRO-3, FSDP2) the waits hide
inside every layer's all-gather and reduce-scatter and count as busy, so their bubble is a lower bound (the
simulator's collective model gives the compute-only figure). ODC's lock-step baseline (``odc.lockstep``) is in
between: on CPU its per-layer meetings hold the host, which times them, and they count as waiting; on CUDA they
wait on the device, as a collective does, and count as busy (``ds_odc.zero.engine.lockstep_waits(engine)`` has the
device's time in them, which overlaps other streams' work).

The same per-rank numbers (busy seconds, tokens, sum of squared document lengths, microbatches) are what the
balancer's automatic cost fits (``BalancedBatchSampler.observe``).

Where blocks are compiled (``ds_odc.training.compile``) each record carries dynamo's counters after its step (this
rank's: graphs, compiled frames, graph breaks), and the summary says how many frames were compiled after the second
minibatch (``compiled_after_step_2``: 0 when new lengths never recompile) and during the timed steps
(``compiled_while_timed``: above 0, the throughput includes compiling; more warm-up steps leave it out).
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Iterable, Sequence

import torch

__all__ = ["StepClock", "gather_step", "summarize"]


def _accelerator():
    """The current accelerator (CUDA, XPU, ...) if this process uses one, else None."""
    acc = getattr(torch, "accelerator", None)
    if acc is None or not acc.is_available():
        return None
    module = getattr(torch, acc.current_accelerator().type, None)
    is_init = getattr(module, "is_initialized", None)
    return module if is_init is not None and is_init() else None


def device_sync() -> None:
    """Wait for the device's queued work, so host clocks measure it (a no-op on CPU)."""
    module = _accelerator()
    if module is not None:
        module.synchronize()


def peak_memory_bytes() -> int:
    module = _accelerator()
    return int(module.max_memory_allocated()) if module is not None and hasattr(module, "max_memory_allocated") else 0


@dataclass
class RankStep:
    busy_s: float
    wait_s: float
    microbatches: int
    tokens: int
    sq_tokens: int = 0  # sum over this rank's documents of length^2 (attention's share of the cost)
    device_wait_s: float = 0.0  # with odc.lockstep on CUDA: seconds its meetings waited on the device (in busy_s)


@dataclass
class StepRecord:
    loss: float
    samples_per_s: float
    tokens_per_s: float
    bubble_rate: float
    step_time_s: float
    peak_mem_bytes: int
    num_samples: int = 0
    per_rank: list[RankStep] = field(default_factory=list)
    cost: dict | None = None  # the automatic cost after this step (BalancedBatchSampler.observe), if any
    compiled: dict | None = None  # dynamo's counters after this step on this rank, once anything was compiled

    def as_dict(self) -> dict:
        return asdict(self)


class StepClock:
    """Times one optimizer step on this rank: ``start()`` before the first microbatch, ``finish(wait_s)`` after the
    optimizer step, with the seconds the step spent waiting for other ranks."""

    def start(self) -> None:
        device_sync()
        self.t0 = time.perf_counter()

    def finish(self, wait_s: float = 0.0) -> tuple[float, float]:
        """Returns (busy_s, step_time_s) of this rank."""
        device_sync()
        step_time = time.perf_counter() - self.t0
        return max(step_time - wait_s, 0.0), step_time


def gather_step(loss_sum: float, busy_s: float, step_time_s: float, microbatches: int, tokens: int,
                num_samples: int, group=None, sq_tokens: int = 0, device_wait_s: float = 0.0) -> StepRecord:
    """Collect every rank's numbers (one small collective) and derive the step's record. ``loss_sum`` is this
    rank's share of the global mean loss (the shares add up to it). Every rank gets the same record.
    ``device_wait_s``: waits that happened on the device inside ``busy_s`` (ODC's lock-step meetings on CUDA)."""
    import torch.distributed as dist
    mine = [float(loss_sum), float(busy_s), float(step_time_s), float(microbatches), float(tokens), float(sq_tokens),
            float(device_wait_s)]
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    rows = [mine] if world == 1 else [None] * world
    if world > 1:
        dist.all_gather_object(rows, mine, group=group)
    return record_from_rows(rows, num_samples)


def record_from_rows(rows: Sequence[Sequence[float]], num_samples: int) -> StepRecord:
    """The step's record from every rank's ``[loss share, busy, step time, microbatches, tokens, sq_tokens]`` (and
    optionally the device wait inside busy)."""
    world = len(rows)
    step_time = max(r[2] for r in rows)
    busy = [min(r[1], step_time) for r in rows]
    total_tokens = sum(int(r[4]) for r in rows)
    return StepRecord(
        loss=sum(r[0] for r in rows),
        samples_per_s=num_samples / step_time if step_time > 0 else 0.0,
        tokens_per_s=total_tokens / step_time if step_time > 0 else 0.0,
        bubble_rate=1.0 - sum(busy) / (world * step_time) if step_time > 0 else 0.0,
        step_time_s=step_time,
        peak_mem_bytes=peak_memory_bytes(),
        num_samples=int(num_samples),
        per_rank=[RankStep(b, step_time - b, int(r[3]), int(r[4]), int(r[5]), float(r[6]) if len(r) > 6 else 0.0)
                  for b, r in zip(busy, rows)],
        compiled=_compile_counts(),
    )


def _compile_counts() -> dict | None:
    if "torch._dynamo" not in sys.modules:  # nothing compiled (and no need to import dynamo to say so)
        return None
    from ds_odc.training.compile import compile_counts
    counts = compile_counts()
    return counts.as_dict() if counts.frames else None


def bubble_rate(records: Sequence[StepRecord]) -> float:
    """Time-weighted bubble of several steps: ``1 - sum busy / (R * sum step_time)``."""
    total = sum(r.step_time_s for r in records)
    if total <= 0:
        return 0.0
    world = len(records[0].per_rank)
    return 1.0 - sum(p.busy_s for r in records for p in r.per_rank) / (world * total)


def summarize(records: list[StepRecord], warmup_steps: int, world_size: int, untimed: Iterable[int] = ()) -> dict:
    """Throughput and bubble over the timed steps (after ``warmup_steps``, less the ``untimed`` step indices, e.g. a
    profiled one), weighting each step by its time."""
    skip = set(untimed)
    timed_at = [i for i in range(len(records)) if i >= warmup_steps and i not in skip] or list(range(len(records)))
    timed = [records[i] for i in timed_at]
    total = sum(r.step_time_s for r in timed)
    samples_per_s = sum(r.samples_per_s * r.step_time_s for r in timed) / total
    return {
        "samples_per_s": samples_per_s,
        "samples_per_s_per_device": samples_per_s / world_size,
        "tokens_per_s": sum(r.tokens_per_s * r.step_time_s for r in timed) / total,
        "bubble_rate": bubble_rate(timed),
        **_device_wait(timed, total),
        "time_s": total,
        "peak_mem_bytes": max(r.peak_mem_bytes for r in records),
        "final_loss": records[-1].loss,
        **_compile_summary(records, timed_at),
    }


def _device_wait(timed: list[StepRecord], total: float) -> dict:
    """With waits on the device (odc.lockstep on CUDA): their share of the ranks' time, beside the bubble."""
    waited = sum(p.device_wait_s for r in timed for p in r.per_rank)
    if not waited or total <= 0:
        return {}
    return {"device_wait_rate": waited / (len(timed[0].per_rank) * total)}


def _compile_summary(records: list[StepRecord], timed: list[int]) -> dict:
    """Graphs and frames compiled over the run, frames compiled after its second minibatch (recompiles) and frames
    compiled during its timed steps (``timed``: their indices)."""
    if not any(r.compiled for r in records):
        return {}

    def frames_after(i: int) -> int:  # dynamo's counters after step i (none yet before the first step)
        return next((r.compiled["frames"] for r in reversed(records[:i + 1]) if r.compiled), 0)

    last = len(records) - 1
    while_timed = sum(frames_after(i) - frames_after(i - 1) for i in timed)
    return {"compile": {**records[last].compiled, "compiled_after_step_2": frames_after(last) - frames_after(1),
                        "compiled_while_timed": while_timed}}
