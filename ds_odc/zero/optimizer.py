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
whole in this file. What the layers above may use is :attr:`OdcOptimizer.odc_wait_s`,
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
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from deepspeed.runtime.zero.utils import get_norm_dtype
from deepspeed.utils import logger

from ds_odc.config import odc_config_from_ds_config
from ds_odc.ops.lockstep import LockstepTally
from ds_odc.ops.transport import OdcError
from ds_odc.zero import _deepspeed_privates as privates
from ds_odc.zero.coordinator import OdcParamCoordinator
from ds_odc.zero.host_step import HostStep, HostStepTimes, release_pinned
from ds_odc.zero.hybrid import groups_for
from ds_odc.zero.state import OdcState, profiled

__all__ = ["OdcOptimizer"]


class OdcOptimizer(privates.Stage3Seams, DeepSpeedZeroOptimizer_Stage3):
    """``DeepSpeedZeroOptimizer_Stage3`` whose gathers and reduce-scatters are one-sided transport operations."""

    coordinator_class = OdcParamCoordinator  # what the parameter coordinator DeepSpeed builds becomes
    odc: OdcState  # how shards and gradients move: set before DeepSpeed's constructor runs
    host_step: HostStep | None = None  # with offload_optimizer: the gradients' way to the host, the parameters' back

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

    def gradient_norms(self) -> list[torch.Tensor] | None:
        """Each group's gradient norm, as stock's step takes them (``_get_norm_groups``), or None to leave it to
        stock. Stock takes one norm per parameter (several tensor ops each, hundreds per step) over views of what under
        ODC is one flat fp32 accumulator, where each group's gradients are one contiguous range; so one norm per group,
        summed over the same process group, with stock's -1 for a non-finite norm. The squares add up in stock's norm
        dtype (float64 where the device has it; :func:`sum_of_squares`), so the norm rounds as stock's does."""
        flats = [self.odc.accumulated(group) if all(p.requires_grad for p in group) else None
                 for group in self.fp16_groups]
        if any(flat is None for flat in flats) and self.host_step is None:
            return None  # a frozen parameter in a trainable group: stock counts it as zeros
        # (with offload_optimizer stock's norms come from gradient copies ODC does not make: such a group is normed
        # over its trainable parameters' partitions here)
        views = privates.grad_partition_map(self)
        norms = []
        for group, flat in zip(self.fp16_groups, flats):
            if flat is not None:
                total = sum_of_squares(flat).reshape(1)
            else:
                total = torch.zeros(1, dtype=get_norm_dtype(), device=self.odc.accumulator.local.device)
                for param in group:
                    if param.requires_grad:
                        total += sum_of_squares(views[param.ds_id])
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self._get_param_partition_group(group[0]))
            norm = total.sqrt().squeeze(0)
            norm = torch.where(norm.isfinite(), norm, torch.full_like(norm, -1.0))
            norms.append(norm if self.host_step is None else norm.cpu())  # offloaded: clipping scales host tensors
        return norms

    def host_gradients(self, sub_group_id: int) -> None:
        """With ``offload_optimizer``, inside the step: sub-group ``sub_group_id``'s gradient is on the host (in its
        fp32 master's ``.grad``, where stock's CPU step reads it) once this returns."""
        if self.host_step is not None:
            self.host_step.ready(sub_group_id)

    def copy_back_parameters(self, sub_group_id: int) -> bool:
        """With ``offload_optimizer``, inside the step: start copying sub-group ``sub_group_id``'s new parameters into
        its shards (finished before the publish). False: copy as stock does."""
        return self.host_step is not None and self.host_step.copy_back(sub_group_id)

    def refresh_persistent_parameters(self) -> None:
        """Re-read the persistent parameters (small ones that stay gathered) from their owners' updated shards, as
        stock does after its update; published shards only, hence after the publish."""
        if self.persistent_parameters:
            self.odc.fetch_now(self.persistent_parameters)

    # -- placement and release (called from DeepSpeed's own code, through the overrides) -------------------------------
    def place_trainable_shards(self) -> None:
        """Move the flat buffer of trainable shards (``lp_param_buffer``) into symmetric memory that peers read, right
        after stock builds it and before anything aliases it, and route each parameter's gathers through ODC."""
        # where the shards are (with offload_optimizer, stock's self.device is the CPU)
        self.odc.connect(self.lp_param_buffer.device, self.dp_process_group)
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


_ROW = 256  # elements whose squares add up in fp32 before the sum goes on in the norm dtype


def sum_of_squares(grad: torch.Tensor) -> torch.Tensor:
    """``sum(grad ** 2)`` as a 0-dim tensor of stock ZeRO-3's norm dtype (``get_norm_dtype()``: float64 where the
    device has it), without a full-size copy in that dtype: fp32 sums over rows of 256 elements (a few roundings
    each), then the rows' sums in the norm dtype. An fp32 sum over a whole accumulator rounds once per element on a
    CPU's vector lanes: hundreds of ulps on a large one, and more on one CPU's kernels than on another's."""
    dtype, flat = get_norm_dtype(), grad.reshape(-1)
    whole = flat.numel() - flat.numel() % _ROW
    rows = torch.linalg.vector_norm(flat[:whole].view(-1, _ROW), 2, dim=1, dtype=torch.float32)
    return rows.to(dtype).square().sum() + flat[whole:].to(dtype).square().sum()
