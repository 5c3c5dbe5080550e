"""The parameter coordinator under ODC: DeepSpeed's own (trace, prefetch, streams, release), with its all-gather
replaced by one-sided reads through the engine's :class:`~ds_odc.zero.state.OdcState` (``OdcState.fetch_missing``)."""

from __future__ import annotations

from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

from ds_odc.zero import _deepspeed_privates as privates

__all__: list[str] = []


class OdcParamCoordinator(privates.CoordinatorSeams, PartitionedParameterCoordinator):
    """``PartitionedParameterCoordinator`` whose fetches and prefetches read the owners' shards one-sidedly and whose
    per-forward trace checks (collectives) are off. An ODC optimizer re-classes the instance DeepSpeed built and sets
    its ``odc`` (declared by ``CoordinatorSeams``, whose overrides forward to it)."""
