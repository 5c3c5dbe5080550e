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

DeepSpeed reaches this class through its private members too; their overrides live in ``_deepspeed_privates``
(:class:`~ds_odc.zero._deepspeed_privates.Stage3Seams`, inherited), each forwarding to a collaborator this class
holds and hands them: its :class:`~ds_odc.zero.state.OdcState` (``odc``), its
:class:`~ds_odc.zero.host_step.HostStep` (``host_step``) or :func:`~ds_odc.zero.norms.gradient_norms`; none calls
back into this class. What the layers above may use is :attr:`OdcOptimizer.odc_wait_s`,
:attr:`OdcOptimizer.odc_lockstep`, :attr:`OdcOptimizer.odc_host_step_times` and :meth:`OdcOptimizer.odc_resident`
(and the functions of :mod:`ds_odc.zero.engine`); nothing else.

With ``"offload_optimizer": {"device": "cpu"}`` the fp32 master weights and the optimizer state live on the host as
under stock, while the accumulator stays on the device: the step copies each sub-group's gradient to the host and its
new parameters back (:mod:`ds_odc.zero.host_step`), and the gradient APIs read the accumulator, as stock without
offload does. ``engine.offload_states()`` moves the symmetric buffers too where the transport can give their memory
back (:meth:`OdcOptimizer.offload_states`).

With ``odc.shard_size`` DeepSpeed partitions over the shard group instead of the whole job (the optimizer's
``dp_process_group``; ``zero.Init`` picks the same group from the config), and the fence also sums every
accumulated shard over its replicas (:mod:`ds_odc.zero.hybrid`).
"""

from __future__ import annotations

import contextlib
import itertools

import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from deepspeed.utils import logger

from ds_odc.config import odc_config_from_ds_config
from ds_odc.ops.lockstep import LockstepTally
from ds_odc.ops.transport import OdcError
from ds_odc.zero import _deepspeed_privates as privates
from ds_odc.zero.coordinator import OdcParamCoordinator
from ds_odc.zero.host_step import HostStep, HostStepTimes, release_pinned
from ds_odc.zero.hybrid import groups_for
from ds_odc.zero.state import OdcState, profiled

__all__: list[str] = []


class OdcOptimizer(privates.Stage3Seams, DeepSpeedZeroOptimizer_Stage3):
    """``DeepSpeedZeroOptimizer_Stage3`` whose gathers and reduce-scatters are one-sided transport operations."""

    coordinator_class = OdcParamCoordinator  # what the parameter coordinator DeepSpeed builds becomes
    # (and from Stage3Seams: ``odc``, the OdcState, set before DeepSpeed's constructor runs; ``host_step``)

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
        super().__init__(*args, **kwargs)  # places the trainable shards on the way (Stage3Seams)
        trainable = {p.ds_id for p in self._trainable()}
        frozen = [p for p in self.module.parameters() if hasattr(p, "ds_id") and p.ds_id not in trainable]
        self.odc.place_frozen(frozen)
        for param in frozen:
            privates.bind_param_methods(param, self.odc)
        self.odc.sync_replicas(self.odc.frozen)
        privates.list_module_parameters_once(self.module)
        views = self.odc.place_accumulator(self._trainable(), self.grad_partitions_flat_buffer.numel())
        stock_partitions = [self.grad_partitions_flat_buffer]  # pinned host memory under offload_optimizer
        self.grad_partitions_flat_buffer = self.odc.accumulator.local
        privates.grad_partition_map(self).update(views)
        release_pinned(stock_partitions)
        if self.offload_optimizer:
            self.host_step = HostStep([self.odc.accumulated(group) for group in self.fp16_groups],
                                      self.fp32_partitioned_groups_flat, self.fp16_partitioned_groups_flat,
                                      pin_memory=self.offload_optimizer_pin_memory)
        transport = self.odc.transport
        layout = "" if groups is None else f" in each of {groups.layout.replicas} shard groups (replicas)"
        host = ", optimizer on the host" if self.host_step is not None else ""
        logger.info(f"ds_odc: ODC on, transport={transport.name}, {transport.world_size} ranks{layout}, "
                    f"shards={self.odc.trainable.numel} elements, accumulator={self.odc.accumulator.numel} elements"
                    f"{host}")

    def _trainable(self):
        return itertools.chain.from_iterable(self.fp16_groups)

    # -- the public surface: what code outside ds_odc.zero may use ---------------------------------------------------
    @property
    def odc_wait_s(self) -> float:
        """Seconds the last step's host waited for peers: fence + publish, and with ``odc.lockstep`` on a host
        transport (CPU) the lock-step meetings since the step before."""
        return self.odc.wait_s

    @property
    def odc_lockstep(self) -> LockstepTally | None:
        """With ``odc.lockstep``: the lock-step meetings of the last step (since the step before) and the seconds
        waited in them, the host's (counted in :attr:`odc_wait_s`) or, on CUDA (``on_device``), the device's time
        inside the meetings' kernels, summed over the streams they ran on: a meeting on the prefetch stream can wait
        while the block before computes, and one on the gradient stream at the same time, so this is more than the
        time the device idled. None without lockstep."""
        return self.odc.lockstep_step

    @property
    def odc_host_step_times(self) -> HostStepTimes | None:
        """With ``offload_optimizer``: the last step's host seconds by phase (copy out, CPU optimizer, copy back)."""
        return None if self.host_step is None else self.host_step.times

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
            if self.host_step is not None:
                self.host_step.start()  # see [Note: the host step] in ds_odc.zero.host_step
            super().step(closure)
            if self.host_step is not None:
                self.host_step.finish()
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

    def refresh_persistent_parameters(self) -> None:
        """Re-read the persistent parameters (small ones that stay gathered) from their owners' updated shards, as
        stock does after its update; published shards only, hence after the publish."""
        if self.persistent_parameters:
            self.odc.fetch_now(self.persistent_parameters)

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

    # -- states put away while something else uses the device (DeepSpeed's offload_states / reload_states) ----------
    def offload_states(self, include=None, device=OffloadDeviceEnum.cpu, pin_memory=True, non_blocking=False):
        """DeepSpeed's ``offload_states``, with ODC's symmetric buffers: ``lp_params`` (every shard buffer, frozen
        parameters' included) and ``lp_grads`` (the accumulator) go to host copies and their memory is given back,
        where the transport can (shared memory on CPU; see :meth:`OdcState.put_away_buffers`: every rank calls it);
        the other states move as stock moves them."""
        wanted = list(OffloadStateTypeEnum) if include is None else list(include)
        ours = [s for s in _SYMMETRIC_STATES if s in wanted and s not in self.offloaded_states]
        if ours:
            self._put_away_symmetric(ours, pin_memory)
        super().offload_states(include=[s for s in wanted if s not in _SYMMETRIC_STATES], device=device,
                               pin_memory=pin_memory, non_blocking=non_blocking)

    def reload_states(self, non_blocking=False):
        """DeepSpeed's ``reload_states``; ODC's symmetric buffers come back to their places (every rank calls it when
        ``lp_params`` or ``lp_grads`` were offloaded)."""
        ours = [s for s in _SYMMETRIC_STATES if s in self.offloaded_states]
        self.offloaded_states.difference_update(ours)
        super().reload_states(non_blocking=non_blocking)
        if ours:
            self.odc.bring_back("engine.reload_states()")
        self._shards_home()
        if OffloadStateTypeEnum.lp_grads in ours:
            self._point_gradients(self.odc.accumulator.local)

    def _put_away_symmetric(self, states: list, pin_memory: bool) -> None:
        transport = self.odc.transport
        if not transport.can_evict:
            raise OdcError(self._cannot_move(states))
        buffers = (self.odc.shard_buffers() if OffloadStateTypeEnum.lp_params in states else []) + \
            ([self.odc.accumulator] if OffloadStateTypeEnum.lp_grads in states else [])
        pin = get_accelerator().pin_memory if pin_memory else (lambda t: t)
        self.odc.put_away_buffers(buffers, pin, "engine.offload_states()")
        if OffloadStateTypeEnum.lp_params in states:
            host = self.odc.host_copy(self.odc.trainable)
            self.lp_param_buffer = host
            for flat, (offset, numel) in zip(self.fp16_partitioned_groups_flat, self._shard_ranges()):
                flat.data = host.narrow(0, offset, numel)
        if OffloadStateTypeEnum.lp_grads in states:
            self._point_gradients(self.odc.host_copy(self.odc.accumulator))
        self.offloaded_states.update(states)

    def _shards_home(self) -> None:
        """Point every sub-group's shard range (and ``lp_param_buffer``) at the symmetric buffer again, keeping what
        it holds: stock's ``reload_states`` re-homes the fp32 master, which in fp32 training *is* the shard range."""
        home = self.odc.trainable.local
        for flat, (offset, numel) in zip(self.fp16_partitioned_groups_flat, self._shard_ranges()):
            place = home.narrow(0, offset, numel)
            if flat.data_ptr() != place.data_ptr():
                place.copy_(flat.data)
                flat.data = place
        self.lp_param_buffer = home

    def _shard_ranges(self) -> list[tuple[int, int]]:
        ranges, offset = [], 0
        for numel in self.fp16_partitioned_groups_flat_numel:
            ranges.append((offset, numel))
            offset += numel
        return ranges

    def _point_gradients(self, flat: torch.Tensor) -> None:
        """``grad_partitions_flat_buffer`` and each parameter's gradient partition as views of ``flat``."""
        self.grad_partitions_flat_buffer = flat
        privates.grad_partition_map(self).update(
            {ds_id: flat.narrow(0, place.offset, place.numel) for ds_id, place in self.odc.grads.items()})
        self.averaged_gradients = {}

    def _cannot_move(self, states: list) -> str:
        shards = sum(b.numel * b.local.element_size() for b in self.odc.shard_buffers())
        sizes = {OffloadStateTypeEnum.lp_params: shards, OffloadStateTypeEnum.lp_grads: self.odc.accumulator.numel * 4}
        named = " and ".join(f"{s.value} ({_size(sizes[s])} on this rank)" for s in states)
        rest = [s.value for s in OffloadStateTypeEnum if s not in _SYMMETRIC_STATES]
        host = (" With offload_optimizer the fp32 master weights and the optimizer state already live on the host."
                if self.offload_optimizer else "")
        return (f"ds_odc: engine.offload_states() cannot move {named} with ODC on the {self.odc.transport.name} "
                "transport: under ODC peers read every rank's parameter shards and push into its gradient "
                "accumulator one-sidedly, in symmetric memory that the transport cannot give back while the job "
                f"runs.{host} Leave them out, e.g. engine.offload_states(include={rest}) (OffloadStateTypeEnum "
                "members), or turn zero_optimization.odc off.")


_SYMMETRIC_STATES = (OffloadStateTypeEnum.lp_params, OffloadStateTypeEnum.lp_grads)


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"
