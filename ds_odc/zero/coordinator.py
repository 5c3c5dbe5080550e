"""The parameter coordinator under ODC: DeepSpeed's own (trace, prefetch, streams, release), with its all-gather
replaced by one-sided reads through the engine's :class:`~ds_odc.zero.state.OdcState`."""

from __future__ import annotations

from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

from ds_odc.zero import _deepspeed_privates as privates

__all__ = ["OdcParamCoordinator"]


class OdcParamCoordinator(privates.CoordinatorSeams, PartitionedParameterCoordinator):
    """``PartitionedParameterCoordinator`` whose fetches and prefetches read the owners' shards one-sidedly and whose
    per-forward trace checks (collectives) are off. ``odc`` is set when an ODC optimizer re-classes the instance."""
