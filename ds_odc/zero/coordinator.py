"""The parameter coordinator under ODC: DeepSpeed's own (trace, prefetch, streams, release), with its all-gather
replaced by one-sided reads through the engine's :class:`~ds_odc.zero.state.OdcState` (``OdcState.fetch_missing``).

With ``odc.lockstep`` it also holds the lock-step meetings (``CoordinatorSeams.fetch_sub_module`` and
``release_sub_module``), at the two points where collective ZeRO-3 makes every rank wait for every other in each
block: before the block's forward fetch (forward and recomputation alike) and after its backward. Both are decided
by which modules run, never by what happens to need reading (prefetches, parameters still available, DeepSpeed's
trace), so every rank meets equally often whatever its rows' lengths.
"""

from __future__ import annotations

from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

from ds_odc.zero import _deepspeed_privates as privates

__all__: list[str] = []


class OdcParamCoordinator(privates.CoordinatorSeams, PartitionedParameterCoordinator):
    """``PartitionedParameterCoordinator`` whose fetches and prefetches read the owners' shards one-sidedly and whose
    per-forward trace checks (collectives) are off. An ODC optimizer re-classes the instance DeepSpeed built and sets
    its ``odc`` (declared by ``CoordinatorSeams``, whose overrides forward to it)."""
