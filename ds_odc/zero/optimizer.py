"""The ZeRO-3 optimizer with ODC: gradient pushes and the optimizer-step fence (hops two and three).

Data path per minibatch, on every rank, with any number of microbatches (0 included):

* backward: each gradient bucket is pushed, slice by slice, into the owners' fp32 accumulation partitions
  (``odc_push_grads``); nobody waits for anybody.
* ``step()``: ``fence`` (every rank arrived, every push landed) -> DeepSpeed's own step on this rank's partition
  (norm, clipping and update are stock, including their collectives, which every rank now joins exactly once)
  -> zero the accumulator -> ``barrier`` (new shards and empty accumulators visible) -> next minibatch.
"""

from __future__ import annotations

import itertools
import time

import torch
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from deepspeed.utils import logger

from ds_odc.config import odc_config_from_ds_config
from ds_odc.ops import make_transport
from ds_odc.ops.transport import Segment, SymmetricBuffer
from ds_odc.zero import _deepspeed_privates as privates
from ds_odc.zero.gather import OdcParamCoordinator, ParamGather


class OdcOptimizer(privates.Stage3Seams, DeepSpeedZeroOptimizer_Stage3):
    """``DeepSpeedZeroOptimizer_Stage3`` whose gathers and reduce-scatters are one-sided transport operations."""

    def __init__(self, *args, **kwargs):
        self.odc_config = odc_config_from_ds_config(kwargs["ds_config"])
        self.odc_transport = None
        self.odc_gather: ParamGather | None = None
        self.odc_shards: SymmetricBuffer | None = None
        self.odc_accumulator: SymmetricBuffer | None = None
        self.odc_grad_offsets: dict[int, int] = {}
        self._odc_published = True
        self.odc_wait_s = 0.0  # time the last step spent waiting for peers (fence + barrier): metrics read it
        super().__init__(*args, **kwargs)
        self._odc_place_frozen_shards()
        self._odc_rehome_accumulator()
        logger.info(f"ds_odc: ODC on, transport={self.odc_transport.name}, world={self.odc_transport.world_size}, "
                    f"shards={self.odc_shards.numel} elements, accumulator={self.odc_accumulator.numel} elements")

    # -- setup ------------------------------------------------------------------------------------------------------
    def _odc_get_transport(self):
        if self.odc_transport is None:
            device = torch.device(self.device) if not isinstance(self.device, torch.device) else self.device
            self.odc_transport = make_transport(self.odc_config, device, self.dp_process_group)
            self.odc_gather = ParamGather(self.odc_transport)
        return self.odc_transport

    def initialize_ds_offload(self, *args, **kwargs):
        offload = super().initialize_ds_offload(*args, **kwargs)
        privates.use_coordinator_class(offload, OdcParamCoordinator)
        return offload

    def _odc_move_into(self, buffer: SymmetricBuffer, params, base: torch.Tensor | None) -> None:
        """Copy each param's shard into ``buffer`` and make its ``ds_tensor`` a view of it. Offsets come from where
        the shard sat in ``base`` (DeepSpeed's own flat layout), or are packed in order when there is no base."""
        offset = 0
        for param in params:
            shard = param.ds_tensor
            if base is not None:
                offset = (shard.data_ptr() - base.data_ptr()) // shard.element_size()
            view = buffer.local.narrow(0, offset, shard.numel())
            view.copy_(shard.data.reshape(-1))
            shard.data = view.view(shard.shape)
            self.odc_gather.register(param, buffer, offset)
            offset += shard.numel()

    def odc_place_trainable_shards(self) -> None:
        if self.odc_shards is not None:
            raise NotImplementedError("ds_odc: re-homing parameter shards (offload_states / reload_states) is not "
                                      "supported with ODC")
        stock = self.lp_param_buffer
        transport = self._odc_get_transport()
        self.odc_shards = transport.allocate(stock.numel(), stock.dtype)
        self._odc_move_into(self.odc_shards, itertools.chain.from_iterable(self.fp16_groups), stock)
        self.lp_param_buffer = self.odc_shards.local

    def _odc_place_frozen_shards(self) -> None:
        """Frozen ZeRO params are not in ``lp_param_buffer``; give them symmetric buffers of their own (per dtype)."""
        trainable = {p.ds_id for p in itertools.chain.from_iterable(self.fp16_groups)}
        frozen = [p for p in self.module.parameters() if hasattr(p, "ds_id") and p.ds_id not in trainable]
        frozen.sort(key=lambda p: p.ds_id)
        self.odc_frozen_shards = []
        for dtype in sorted({p.ds_tensor.dtype for p in frozen}, key=str):
            params = [p for p in frozen if p.ds_tensor.dtype == dtype]
            buffer = self.odc_transport.allocate(sum(p.ds_tensor.numel() for p in params), dtype)
            self._odc_move_into(buffer, params, None)
            self.odc_frozen_shards.append(buffer)

    def _odc_rehome_accumulator(self) -> None:
        """Move DeepSpeed's gradient accumulation partition into transport memory, where peers push. Always fp32:
        pushes from many microbatches and ranks add up there (stock bf16 training would accumulate in bf16)."""
        stock = self.grad_partitions_flat_buffer
        self.odc_accumulator = self.odc_transport.allocate(stock.numel(), torch.float32, accumulator=True)
        self.grad_partitions_flat_buffer = self.odc_accumulator.local
        views = privates.grad_partition_map(self)
        offset = 0
        for param in itertools.chain.from_iterable(self.fp16_groups):
            views[param.ds_id] = self.odc_accumulator.local.narrow(0, offset, param.partition_numel())
            self.odc_grad_offsets[param.ds_id] = offset
            offset += param.partition_numel()

    # -- hop two: gradients -------------------------------------------------------------------------------------
    def odc_push_grads(self, params) -> list:
        """Push every gradient slice to its owner's accumulator, averaged over the data-parallel ranks (as the
        reduce-scatter it replaces)."""
        segments = [Segment(self.odc_grad_offsets[p.ds_id], p.partition_numel()) for p in params]
        grads = [p.grad.reshape(-1) for p in params]
        self.odc_transport.scatter_accumulate(self.odc_accumulator, segments, grads,
                                              scale=1.0 / self.odc_transport.world_size)
        self._odc_published = False
        return [None] * len(params)

    def partition_grads(self, params_to_release, grad_partitions) -> list:
        # Pushes already accumulated at the owners; stock's copy-or-add into the local partition must not run.
        for param in params_to_release:
            if param.grad is not None and param.grad.is_cuda:
                param.grad.record_stream(torch.cuda.current_stream())
            param.grad = None
        return []

    # -- hop three: the step --------------------------------------------------------------------------------------
    def step(self, closure=None):
        started = time.perf_counter()
        self.odc_transport.fence([self.odc_accumulator])
        self.odc_wait_s = time.perf_counter() - started
        # A rank that ran no backward this minibatch never set its gradient views; the pushes of others still count.
        views = privates.grad_partition_map(self)
        for i, group in enumerate(self.fp16_groups):
            self.averaged_gradients[i] = [
                views[p.ds_id] if p.requires_grad else torch.zeros_like(p.ds_tensor, dtype=torch.float32)
                for p in group]
        self._odc_published = False
        super().step(closure)
        if not self._odc_published:  # stock skipped the update (inf/nan gradients): still release the ranks
            self.odc_publish_update()

    def odc_publish_update(self) -> None:
        """Empty the accumulator and meet the other ranks, so that nobody reads a shard before its owner updated it
        or pushes into an accumulator before its owner emptied it."""
        self.odc_transport.zero_([self.odc_accumulator])
        started = time.perf_counter()
        self.odc_transport.barrier()
        self.odc_wait_s += time.perf_counter() - started
        self._odc_published = True

    # -- things ODC does not do ------------------------------------------------------------------------------------
    def offload_states(self, *args, **kwargs):
        raise NotImplementedError("ds_odc: offload_states() is not supported with ODC (it moves the symmetric "
                                  "parameter buffer); turn zero_optimization.odc off to use it")

    def reload_states(self, *args, **kwargs):
        raise NotImplementedError("ds_odc: reload_states() is not supported with ODC; turn zero_optimization.odc off")

    def load_state_dict(self, *args, **kwargs):
        super().load_state_dict(*args, **kwargs)
        self._odc_check_placement()
        self.odc_transport.barrier()  # loaded shards visible to readers

    def _odc_check_placement(self) -> None:
        """Loading a checkpoint must leave every shard in symmetric memory (peers read it there)."""
        local = self.odc_shards.local
        lo, hi = local.data_ptr(), local.data_ptr() + local.numel() * local.element_size()
        for param in itertools.chain.from_iterable(self.fp16_groups):
            if not lo <= param.ds_tensor.data_ptr() < hi:
                raise RuntimeError("ds_odc: a checkpoint load moved parameter shards out of symmetric memory; "
                                   "this DeepSpeed version is not supported with ODC")
