"""The parameter coordinator under ODC: DeepSpeed's own (trace, prefetch, streams, release), with its all-gather
replaced by one-sided reads through the engine's :class:`~ds_odc.zero.state.OdcState`."""

from __future__ import annotations

from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

from ds_odc.zero import _deepspeed_privates as privates
from ds_odc.zero.state import OdcState

__all__ = ["OdcParamCoordinator"]


class OdcParamCoordinator(privates.CoordinatorSeams, PartitionedParameterCoordinator):
    """``PartitionedParameterCoordinator`` whose fetches and prefetches read the owners' shards one-sidedly and whose
    per-forward trace checks (collectives) are off. An ODC optimizer re-classes the instance DeepSpeed built and sets
    ``odc``; the overrides in ``_deepspeed_privates`` forward here."""

    odc: OdcState

    def fetch_params(self, params, quantize: bool = False) -> None:
        """The coordinator's gather, for fetches and prefetches alike: read the partitioned ones among ``params`` from
        their owners on the coordinator's fetch stream, counted where it counts gathered elements. The reads are not
        registered as in flight: every ``fetch_sub_module`` ends by ordering the compute stream after the fetch
        stream, so the per-parameter wait that registering buys (a stream switch and an event per parameter, per
        block, per microbatch) adds only host time."""
        if quantize:
            raise RuntimeError("ds_odc: quantized parameter fetches are not supported with ODC")
        todo = [p for p in params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
        if not todo:
            return
        privates.count_available(self, sum(p.ds_numel for p in todo))
        with get_accelerator().stream(privates.fetch_stream(self)):
            self.odc.fetch(todo).wait()
