"""Parameter fetching by one-sided reads: the first hop of ODC's data path.

DeepSpeed's coordinator decides *when* a module's parameters are fetched and released (trace, prefetch, streams,
release all stay stock); this module changes *how*: instead of an all-gather that every rank must join, the reader
assembles each full parameter from its owners' shards in their symmetric buffers. One transport call per fetch
bucket, not per parameter.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable

import torch
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

from ds_odc.ops.transport import Segment, SymmetricBuffer, Transport
from ds_odc.zero import _deepspeed_privates as privates


class OdcGatherHandle:
    """What the coordinator waits on. The reads were enqueued on the all-gather stream when the handle was made, and
    the coordinator orders the compute stream after that stream, so waiting only marks the params available."""

    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = params
        self.complete = False

    def wait(self, handle_dependency: bool = True, **kwargs) -> None:
        if self.complete:
            return
        for param in self.params:
            param.ds_status = ZeroParamStatus.AVAILABLE
        self.complete = True


class ParamGather:
    """Knows where every parameter's shard lives (buffer, offset) and fetches full parameters from the owners."""

    def __init__(self, transport: Transport):
        self.transport = transport
        self.places: dict[int, tuple[SymmetricBuffer, int]] = {}

    def register(self, param: torch.nn.Parameter, buffer: SymmetricBuffer, offset: int) -> None:
        self.places[param.ds_id] = (buffer, offset)
        privates.bind_param_gathers(
            param,
            self.gather_coalesced,
            lambda param_list=None, async_op=False, hierarchy=0, _param=param: self.gather(
                [_param] if param_list is None else param_list, async_op),
        )

    def gather_coalesced(self, params: Iterable[torch.nn.Parameter], safe_mode: bool = False,
                         quantize: bool = False) -> OdcGatherHandle:
        params = sorted(params, key=lambda p: p.ds_id)
        by_buffer: dict[int, list] = defaultdict(list)
        for param in params:
            if param.ds_status != ZeroParamStatus.NOT_AVAILABLE:
                raise RuntimeError(f"ds_odc: fetching a parameter that is not partitioned: {param.ds_summary()}")
            if param.ds_id not in self.places:
                raise RuntimeError(f"ds_odc: parameter {param.ds_id} has no symmetric shard (was it added to the "
                                   "model after deepspeed.initialize?)")
            param.ds_status = ZeroParamStatus.INFLIGHT
            buffer, _ = self.places[param.ds_id]
            by_buffer[id(buffer)].append(param)
        world = self.transport.world_size
        for group in by_buffer.values():
            buffer = self.places[group[0].ds_id][0]
            segments = [Segment(self.places[p.ds_id][1], p.ds_tensor.ds_numel) for p in group]
            outputs = [torch.empty(world * s.length, dtype=buffer.dtype, device=buffer.local.device) for s in segments]
            self.transport.gather(buffer, segments, outputs)
            for param, full in zip(group, outputs):
                param.data = full.narrow(0, 0, param.ds_numel).view(param.ds_shape)
        return OdcGatherHandle(params)

    def gather(self, params: list, async_op: bool = False):
        """``param.all_gather()``: fetch the listed params that are partitioned, synchronously unless ``async_op``."""
        todo = [p for p in params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
        handle = self.gather_coalesced(todo) if todo else OdcGatherHandle([])
        if async_op:
            return [handle]
        handle.wait()
        return None


class OdcParamCoordinator(PartitionedParameterCoordinator):
    """DeepSpeed's coordinator without the cross-rank trace checks, which are collectives (see privates)."""

    def reset_step(self) -> None:
        with privates.no_rank_consistency_asserts():
            super().reset_step()
