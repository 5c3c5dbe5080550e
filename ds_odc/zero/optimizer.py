"""The ZeRO-3 optimizer with ODC: DeepSpeed's stage-3 optimizer whose data movement is the engine's
:class:`~ds_odc.zero.state.OdcState`.

Per minibatch, on every rank, with any number of microbatches (0 included):

* forward/backward: parameters are fetched and gradients pushed one-sidedly (the coordinator and the gradient
  buckets call the state); nobody waits for anybody;
* :meth:`OdcOptimizer.step`: fence (every rank arrived, every push landed) -> DeepSpeed's own step on this rank's
  partition (norm, clipping and update are stock, including their collectives, which every rank now joins exactly
  once) -> publish (empty the accumulator, meet again: new shards visible) -> next minibatch. ``step`` is the one
  caller of the publish: stock's ``_post_step`` leaves the one thing that needs published shards (re-reading the
  persistent parameters) to it.

DeepSpeed reaches this class through its private members; their overrides live in ``_deepspeed_privates``
(:class:`~ds_odc.zero._deepspeed_privates.Stage3Seams`), each forwarding to a named method here, so the class reads
whole in this file. What the layers above may use is :attr:`OdcOptimizer.odc_wait_s` and
:meth:`OdcOptimizer.odc_resident` (and the functions of :mod:`ds_odc.zero.engine`); nothing else.

With ``odc.shard_size`` DeepSpeed partitions over the shard group instead of the whole job (the optimizer's
``dp_process_group``; ``zero.Init`` picks the same group from the config), and the fence also sums every
accumulated shard over its replicas (:mod:`ds_odc.zero.hybrid`).
"""

from __future__ import annotations

import contextlib
import itertools

import torch
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from deepspeed.utils import logger

from ds_odc.config import odc_config_from_ds_config
from ds_odc.zero import _deepspeed_privates as privates
from ds_odc.zero.coordinator import OdcParamCoordinator
from ds_odc.zero.hybrid import groups_for
from ds_odc.zero.state import OdcState, profiled

__all__ = ["OdcOptimizer"]


class OdcOptimizer(privates.Stage3Seams, DeepSpeedZeroOptimizer_Stage3):
    """``DeepSpeedZeroOptimizer_Stage3`` whose gathers and reduce-scatters are one-sided transport operations."""

    coordinator_class = OdcParamCoordinator  # what the parameter coordinator DeepSpeed builds becomes
    odc: OdcState  # how shards and gradients move: set before DeepSpeed's constructor runs

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
        super().__init__(*args, **kwargs)  # calls place_trainable_shards() on the way
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

    # -- the public surface: what code outside ds_odc.zero may use ---------------------------------------------------
    @property
    def odc_wait_s(self) -> float:
        """Seconds the last step waited for peers (fence + publish)."""
        return self.odc.wait_s

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

    # -- the step ------------------------------------------------------------------------------------------------------
    def step(self, closure=None):
        """Fence -> DeepSpeed's step -> publish -> refresh the persistent parameters. The only caller of
        ``OdcState.publish``, also when stock skips the update (non-finite gradients)."""
        with profiled("ds_odc::step"):
            self.odc.start_step()  # the fence (and the tagged minibatch's check)
            self.present_gradients()
            super().step(closure)
            self.odc.publish()
            if not self.overflow:  # stock refreshes them only after an update
                self.refresh_persistent_parameters()

    def present_gradients(self) -> None:
        """Point stock's per-group gradient lists (``averaged_gradients``, what its step reads) at the accumulator, on
        every rank: a rank that ran no backward this minibatch never set them, and others' pushes still count."""
        views = privates.grad_partition_map(self)
        for i, group in enumerate(self.fp16_groups):
            self.averaged_gradients[i] = [
                views[p.ds_id] if p.requires_grad else torch.zeros_like(p.ds_tensor, dtype=torch.float32)
                for p in group]

    def gradient_norms(self) -> list[torch.Tensor] | None:
        """Each group's gradient norm, as stock's step takes them (``_get_norm_groups``), or None to leave it to
        stock. Stock takes one norm per parameter (several tensor ops each, hundreds per step) over views of what under
        ODC is one flat fp32 accumulator, where each group's gradients are one contiguous range; so one norm per group,
        summed over the same process group, with stock's -1 for a non-finite norm."""
        flats = [self.odc.accumulated(group) if all(p.requires_grad for p in group) else None
                 for group in self.fp16_groups]
        if any(flat is None for flat in flats):  # a frozen parameter in a trainable group: stock counts it as zeros
            return None
        norms = []
        for group, flat in zip(self.fp16_groups, flats):
            total = torch.linalg.vector_norm(flat, 2, dtype=torch.float32).square().reshape(1)
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self._get_param_partition_group(group[0]))
            norm = total.sqrt().squeeze(0)
            norms.append(torch.where(norm.isfinite(), norm, torch.full_like(norm, -1.0)))
        return norms

    def refresh_persistent_parameters(self) -> None:
        """Re-read the persistent parameters (small ones that stay gathered) from their owners' updated shards, as
        stock does after its update; published shards only, hence after the publish."""
        if self.persistent_parameters:
            self.odc.fetch_now(self.persistent_parameters)

    # -- placement and release (called from DeepSpeed's own code, through the overrides) -------------------------------
    def place_trainable_shards(self) -> None:
        """Move the flat buffer of trainable shards (``lp_param_buffer``) into symmetric memory that peers read, right
        after stock builds it and before anything aliases it, and route each parameter's gathers through ODC."""
        device = self.device if isinstance(self.device, torch.device) else torch.device(self.device)
        self.odc.connect(device, self.dp_process_group)
        params = list(self._trainable())
        self.lp_param_buffer = self.odc.place_trainable(params, self.lp_param_buffer)
        self.odc.sync_replicas([self.odc.trainable])  # before stage 3 copies the fp32 master weights from them
        for param in params:
            privates.bind_param_methods(param, self.odc)

    def release_full_gradients(self, params) -> None:
        """Free the full gradients of a pushed bucket (once the stream that pushes them has read them): ODC's pushes
        already went to the owners, so nothing is copied into a local partition."""
        stream = get_accelerator().current_stream()  # None where the device has no streams (CPU)
        for param in params:
            if param.grad is not None and stream is not None:
                param.grad.record_stream(stream)
            param.grad = None

    def release_gathered_parameters(self) -> bool:
        """At the start of the step, release every gathered parameter (False: leave it to stock, which waits for
        gathers in flight). Under ODC nothing is in flight at a step (reads are waited where they are issued), every
        ZeRO parameter is listed already, and a parameter that *is* its shard (one rank) is updated in place by the
        step, so it stays: only other gathered parameters are released."""
        coordinator = self.parameter_offload.get_param_coordinator()
        if privates.has_fetches_in_flight(coordinator):
            return False
        release = privates.release_function(coordinator)
        for param in self.odc.params.values():
            if param.ds_active_sub_modules:
                param.ds_active_sub_modules.clear()
            if param.ds_status != ZeroParamStatus.NOT_AVAILABLE and not self.odc.is_own_shard(param):
                release(param)
                if param.ds_status != ZeroParamStatus.NOT_AVAILABLE:
                    raise RuntimeError(f"{param.ds_summary()} expected to be released")
        return True

    def settled_on_read(self, gradients: dict) -> dict:
        """``averaged_gradients`` as this optimizer keeps it: reading an entry lands this minibatch's pushes first
        (``OdcState.settle``); writing one does not."""
        return _SettlingDict(gradients, self.odc.settle)

    # -- gradients and shards touched outside the step -----------------------------------------------------------------
    def zero_grad(self, set_to_none=True):
        # Before the step this drops the minibatch's gradients so far, as stock does: on every rank, together.
        self.odc.discard("optimizer.zero_grad() before the step")
        super().zero_grad(set_to_none)

    def load_state_dict(self, *args, **kwargs):
        super().load_state_dict(*args, **kwargs)
        self.odc.check_shards_in_place(self._trainable())
        self.odc.publish_writes("loading a checkpoint")

    def destroy(self):
        self.odc.leave("destroyed its engine")
        super().destroy()

    # -- things ODC does not do ------------------------------------------------------------------------------------
    def offload_states(self, *args, **kwargs):
        raise NotImplementedError("ds_odc: offload_states() is not supported with ODC (it moves the symmetric "
                                  "parameter buffer); turn zero_optimization.odc off to use it")

    def reload_states(self, *args, **kwargs):
        raise NotImplementedError("ds_odc: reload_states() is not supported with ODC; turn zero_optimization.odc off")


class _SettlingDict(dict):
    """``averaged_gradients``: reading an entry lands this minibatch's pushes first (writing one does not)."""

    def __init__(self, values, settle):
        super().__init__(values)
        self._settle = settle

    def __getitem__(self, key):
        self._settle("reading optimizer.averaged_gradients")
        return super().__getitem__(key)

    def get(self, key, default=None):
        self._settle("reading optimizer.averaged_gradients")
        return super().get(key, default)

    def items(self):
        self._settle("reading optimizer.averaged_gradients")
        return super().items()

    def values(self):
        self._settle("reading optimizer.averaged_gradients")
        return super().values()
