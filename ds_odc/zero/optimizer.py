"""The ZeRO-3 optimizer with ODC: DeepSpeed's stage-3 optimizer whose data movement is the engine's
:class:`~ds_odc.zero.state.OdcState`.

Per minibatch, on every rank, with any number of microbatches (0 included):

* forward/backward: parameters are fetched and gradients pushed one-sidedly (the coordinator and the gradient
  buckets call the state through ``_deepspeed_privates``); nobody waits for anybody;
* ``step()``: fence (every rank arrived, every push landed) -> DeepSpeed's own step on this rank's partition (norm,
  clipping and update are stock, including their collectives, which every rank now joins exactly once) -> publish
  (empty the accumulator, meet again: new shards visible) -> next minibatch.

With ``odc.shard_size`` DeepSpeed partitions over the shard group instead of the whole job (the optimizer's
``dp_process_group``; ``zero.Init`` picks the same group from the config), and the fence also sums every
accumulated shard over its replicas (:mod:`ds_odc.zero.hybrid`).
"""

from __future__ import annotations

import contextlib
import itertools

import torch
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from deepspeed.utils import logger

from ds_odc.config import odc_config_from_ds_config
from ds_odc.zero import _deepspeed_privates as privates
from ds_odc.zero.coordinator import OdcParamCoordinator
from ds_odc.zero.hybrid import groups_for
from ds_odc.zero.state import OdcState, Phase, profiled

__all__ = ["OdcOptimizer"]


class OdcOptimizer(privates.Stage3Seams, DeepSpeedZeroOptimizer_Stage3):
    """``DeepSpeedZeroOptimizer_Stage3`` whose gathers and reduce-scatters are one-sided transport operations."""

    coordinator_class = OdcParamCoordinator  # what the parameter coordinator DeepSpeed builds becomes

    def __init__(self, *args, **kwargs):
        config = odc_config_from_ds_config(kwargs["ds_config"])
        groups = groups_for(config)
        if groups is not None:
            privates.partition_over(kwargs, groups.shard)
        self.odc = OdcState(config, groups)
        privates.nvtx_ranges_only_under_a_tool()
        # Pushes read each gradient where autograd left it: copying it into a contiguous bucket first (a stream switch,
        # a copy and a bucket-sized buffer) buys nothing when no collective needs one flat tensor.
        kwargs["contiguous_gradients"] = False
        super().__init__(*args, **kwargs)
        trainable = {p.ds_id for p in self._trainable()}
        frozen = [p for p in self.module.parameters() if hasattr(p, "ds_id") and p.ds_id not in trainable]
        self.odc.place_frozen(frozen)
        for param in frozen:
            privates.bind_param_methods(param, self.odc)
        self.odc.sync_replicas(self.odc.frozen)
        privates.list_module_parameters_once(self.module)
        views = self.odc.place_accumulator(self._trainable(), self.grad_partitions_flat_buffer.numel())
        self.grad_partitions_flat_buffer = self.odc.accumulator.local
        privates.grad_partition_map(self).update(views)
        transport = self.odc.transport
        layout = "" if groups is None else f" in each of {groups.layout.replicas} shard groups (replicas)"
        logger.info(f"ds_odc: ODC on, transport={transport.name}, {transport.world_size} ranks{layout}, "
                    f"shards={self.odc.trainable.numel} elements, accumulator={self.odc.accumulator.numel} elements")

    def _trainable(self):
        return itertools.chain.from_iterable(self.fp16_groups)

    @property
    def odc_wait_s(self) -> float:
        """Seconds the last step waited for peers (fence + publish)."""
        return self.odc.wait_s

    def step(self, closure=None):
        with profiled("ds_odc::step"):
            self.odc.start_step()
            self.odc.fence()
            # A rank that ran no backward this minibatch never set its gradient views; others' pushes still count.
            views = privates.grad_partition_map(self)
            for i, group in enumerate(self.fp16_groups):
                self.averaged_gradients[i] = [
                    views[p.ds_id] if p.requires_grad else torch.zeros_like(p.ds_tensor, dtype=torch.float32)
                    for p in group]
            super().step(closure)
            if self.odc.phase is Phase.STEPPING:  # stock skipped the update (inf/nan gradients), so no _post_step
                self.odc.publish()

    def zero_grad(self, set_to_none=True):
        # Before the step this drops the minibatch's gradients so far, as stock does: on every rank, together.
        self.odc.discard("optimizer.zero_grad() before the step")
        super().zero_grad(set_to_none)

    @contextlib.contextmanager
    def odc_resident(self):
        """Read every parameter once (one-sidedly: no collective, ranks need not enter together) and keep it, with
        DeepSpeed's per-module fetch and release off, until the block exits; then release what was read. For
        ``generate`` and evaluation forwards at the unsharded model's speed, at the memory of one full copy."""
        params = [p for p in self.module.parameters() if hasattr(p, "ds_id")]
        read = [p for p in params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
        with privates.zero3_hooks_detached(self.parameter_offload):
            self.odc.fetch_now(read)
            try:
                yield self.module
            finally:
                for param in read:
                    param.ds_active_sub_modules.clear()
                    param.partition()

    # -- things ODC does not do ------------------------------------------------------------------------------------
    def offload_states(self, *args, **kwargs):
        raise NotImplementedError("ds_odc: offload_states() is not supported with ODC (it moves the symmetric "
                                  "parameter buffer); turn zero_optimization.odc off to use it")

    def reload_states(self, *args, **kwargs):
        raise NotImplementedError("ds_odc: reload_states() is not supported with ODC; turn zero_optimization.odc off")

    def load_state_dict(self, *args, **kwargs):
        super().load_state_dict(*args, **kwargs)
        self.odc.check_shards_in_place(self._trainable())
        self.odc.publish_writes("loading a checkpoint")
