"""What code above ``ds_odc.zero`` (and a user's loop) may ask of a ``DeepSpeedEngine`` about ODC: functions that take
the engine, stock engines included, so that nothing outside this package reaches into the optimizer's attributes.
The optimizer's own public members are :attr:`~ds_odc.zero.optimizer.OdcOptimizer.odc_wait_s` and
:meth:`~ds_odc.zero.optimizer.OdcOptimizer.odc_resident`."""

from __future__ import annotations

from ds_odc.zero.optimizer import OdcOptimizer

__all__ = ["holds_replica"]


def holds_replica(engine) -> bool:
    """Whether this rank of ``engine`` holds shards that the first shard group also holds (and writes to
    checkpoints): hybrid sharding (``odc.shard_size``), in any shard group but the first."""
    optimizer = getattr(engine, "optimizer", None)
    groups = optimizer.odc.groups if isinstance(optimizer, OdcOptimizer) else None
    return groups is not None and groups.layout.shard_index > 0
