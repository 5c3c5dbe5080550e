"""What code above ``ds_odc.zero`` (and a user's loop) may ask of a ``DeepSpeedEngine`` about ODC: functions that take
the engine, stock engines included, so that nothing outside this package reaches into the optimizer's attributes;
and :func:`odc_requested`, the same question asked of a ds_config before its engine exists. These are the one answer
to "is ODC on?" above ``ds_odc.zero`` (tests/test_layout.py keeps it so). The optimizer's own public members are :attr:`~ds_odc.zero.optimizer.OdcOptimizer.odc_wait_s`,
:attr:`~ds_odc.zero.optimizer.OdcOptimizer.odc_lockstep`,
:attr:`~ds_odc.zero.optimizer.OdcOptimizer.odc_host_step_times` and
:meth:`~ds_odc.zero.optimizer.OdcOptimizer.odc_resident`."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

from ds_odc.config import odc_config_from_ds_config
from ds_odc.zero import _deepspeed_privates as privates
from ds_odc.zero.host_step import HostStepTimes
from ds_odc.zero.minibatch import MinibatchTag
from ds_odc.zero.optimizer import OdcOptimizer

__all__ = ["tag_minibatch", "host_step_timer", "symmetric_device_bytes"]


def is_odc(engine) -> bool:
    """Whether ``engine`` trains under ODC: the one answer to "is ODC on?" for code above ``ds_odc.zero``."""
    return isinstance(getattr(engine, "optimizer", None), OdcOptimizer)


def odc_requested(ds_config: dict) -> bool:
    """Whether the ds_config dict ``ds_config`` turns ODC on (``zero_optimization.odc``): what :func:`is_odc` answers
    for the engine built from it, asked before that engine exists."""
    return bool(odc_config_from_ds_config(ds_config).enabled)


def wait_seconds(engine) -> float:
    """Seconds the last optimizer step of ``engine`` waited for other ranks on the host (ODC's fence and barrier;
    0.0 for a stock engine, whose waits hide inside its collectives)."""
    optimizer = getattr(engine, "optimizer", None)
    return float(optimizer.odc_wait_s) if isinstance(optimizer, OdcOptimizer) else 0.0


def tag_minibatch(engine, batch: Any = None, *, epoch: int | None = None, step: int | None = None,
                  label_tokens: int | None = None) -> None:
    """Say which minibatch ``engine``'s next ``engine.step()`` trains, so that the step's meeting checks every rank
    is on the same one: ``batch``, the sampler's :class:`~ds_odc.balancer.RankBatch` (its ``epoch``, ``step`` and
    ``num_label_tokens``, whichever it has), and/or the numbers themselves (they override the batch's; ``label_tokens``: the global
    count given to ``global_mean_weight``). Call it on every rank, once per minibatch, before its first microbatch,
    also on a rank that has no microbatch in it. Ranks on different minibatches then all raise
    :class:`~ds_odc.zero.minibatch.MinibatchMismatch` at that step, naming the odd ones, instead of one update
    silently mixing two minibatches. Costs nothing measurable (the tag travels with the step's meeting). Does
    nothing for an engine without ODC."""
    optimizer = getattr(engine, "optimizer", None)
    if not isinstance(optimizer, OdcOptimizer):
        return
    if batch is not None:  # whichever of the three it has (a trainer's pack has no label-token count)
        epoch = getattr(batch, "epoch", None) if epoch is None else epoch
        step = getattr(batch, "step", None) if step is None else step
        label_tokens = getattr(batch, "num_label_tokens", None) if label_tokens is None else label_tokens
    optimizer.odc.tag_minibatch(MinibatchTag(epoch, step, label_tokens))


def holds_replica(engine) -> bool:
    """Whether this rank of ``engine`` holds shards that the first shard group also holds (and writes to
    checkpoints): hybrid sharding (``odc.shard_size``), in any shard group but the first."""
    optimizer = getattr(engine, "optimizer", None)
    groups = optimizer.odc.groups if isinstance(optimizer, OdcOptimizer) else None
    return groups is not None and groups.layout.shard_index > 0


def host_step_timer(engine) -> Callable[[], HostStepTimes] | None:
    """For an engine with ``offload_optimizer`` (ODC's or stock's): a function that returns the host seconds of the
    offloaded step's phases (copy out, CPU optimizer, copy back) since it was last called; call it after each
    ``engine.step()`` that stepped. None without offload. ODC times its own phases (see [Note: the host step] in
    ``ds_odc.zero.host_step``); stock's are timed by wrapping them, which adds a Python call per phase (for
    benchmarks)."""
    optimizer = getattr(engine, "optimizer", None)
    if not getattr(optimizer, "offload_optimizer", False):
        return None
    if isinstance(optimizer, OdcOptimizer):
        return lambda: dataclasses.replace(optimizer.odc_host_step_times)
    totals = HostStepTimes()

    def add(phase: str, seconds: float) -> None:
        setattr(totals, phase, getattr(totals, phase) + seconds)

    privates.time_stock_host_step(optimizer, add)

    def read() -> HostStepTimes:
        since = dataclasses.replace(totals)
        totals.copy_out = totals.optimizer = totals.copy_back = 0.0
        return since

    return read


def symmetric_device_bytes(engine) -> int:
    """Device memory ODC holds in its transport's symmetric heap (shards and accumulator under NVSHMEM), which torch's
    allocator statistics do not count; 0 for stock engines and on CPU."""
    optimizer = getattr(engine, "optimizer", None)
    if not isinstance(optimizer, OdcOptimizer):
        return 0
    return int(getattr(optimizer.odc.transport, "symmetric_bytes", 0))


def lockstep_waits(engine) -> float | None:
    """With ``odc.lockstep``: the seconds the last step's lock-step meetings waited on the device (CUDA; 0.0 where
    the host meets, whose waits ``odc_wait_s`` already counts). None for engines without lockstep."""
    optimizer = getattr(engine, "optimizer", None)
    tally = optimizer.odc_lockstep if isinstance(optimizer, OdcOptimizer) else None
    if tally is None:
        return None
    return tally.wait_s if tally.on_device else 0.0


def destroy_engine(engine) -> None:
    """Destroy ``engine``, an engine built around a model that another engine trains later (TRL builds an inference
    engine around the policy to precompute reference log-probs): DeepSpeed's ``destroy`` takes its ZeRO-3 hooks off the
    model's modules, and the backward functions that DeepSpeed keeps on each module from the first engine built around
    it go too, so that the next engine's backward fetches through its own coordinator (under ODC one-sided reads, not
    the destroyed engine's collective gathers)."""
    engine.destroy()
    privates.forget_backward_functions(engine.module)


def resident_parameters(engine) -> contextlib.AbstractContextManager:
    """For an ODC engine: every parameter read once (one-sidedly) and kept, with DeepSpeed's per-module fetch and
    release off, until the block exits (:meth:`~ds_odc.zero.optimizer.OdcOptimizer.odc_resident`); yields the
    module."""
    if not is_odc(engine):
        raise ValueError("ds_odc: resident_parameters needs an engine with zero_optimization.odc on (got optimizer "
                         f"{type(getattr(engine, 'optimizer', None)).__name__})")
    return engine.optimizer.odc_resident()
