"""The ODC step: one object that owns where every shard and gradient partition lives and how they move.

DeepSpeed's stage-3 optimizer and parameter coordinator keep deciding *when* (trace, prefetch, buckets, release,
the update itself); :class:`OdcState` decides *how*, in four operations:

* :meth:`fetch` (hop one): assemble full parameters from the owners' shards with one-sided reads;
* :meth:`push` (hop two): add this rank's gradient slices into the owners' fp32 accumulators, one-sidedly;
* :meth:`fence` (hop three): the step's meeting, after which every push has landed (at the optimizer step,
  :meth:`start_step`, the ranks also compare the minibatch the loop tagged: :mod:`ds_odc.zero.minibatch`);
* :meth:`publish`: empty the accumulators and meet again, so the updated shards are what peers read next.

It is reached from DeepSpeed only through the ODC optimizer and coordinator (and the overrides in
``_deepspeed_privates`` that forward to them or to it), never calls back, and talks to peers only through a
:class:`~ds_odc.ops.transport.Transport`. Everything that stays the same from
step to step (each parameter's place, each fetch group's and gradient bucket's transport plan) is computed once.

Gradients read, written or dropped between ``backward`` and ``step`` (:meth:`settle`, :meth:`discard`) and shards
written outside the step (:meth:`publish_writes`, replaced shards in :meth:`fetch`) are made to behave as under
stock ZeRO-3, where every rank meets at those points anyway. Where the minibatch stands is one :class:`Phase`.
DeepSpeed's ``offload_states()`` puts whole buffers away on the host and back (:meth:`put_away_buffers`,
:meth:`bring_back`), where the transport can give their memory back meanwhile; the ranks meet around it.

With hybrid sharding (``odc.shard_size``, :mod:`ds_odc.zero.hybrid`) the transport spans one shard group, and the
fence also meets the whole job and sums each accumulated shard over its replicas (:class:`~ds_odc.zero.hybrid.
Replicas`), once per step; shards written outside the step are copied from the first shard group to the others.

With ``odc.lockstep`` (a baseline for measuring) every rank also meets every other at every block: before its
forward fetch and after its backward (:meth:`meet_lockstep`, called by the parameter coordinator, which knows the
blocks), as ZeRO-3's collectives make them wait; nothing else changes. :attr:`OdcState.lockstep_step` counts the
last step's meetings and the time waited in them.

In a torch profiler trace the four operations and the optimizer step are the ranges ``ds_odc::fetch``,
``ds_odc::push``, ``ds_odc::fence``, ``ds_odc::publish`` and ``ds_odc::step`` (and the lock-step meetings
``ds_odc::lockstep``).
"""

from __future__ import annotations

import contextlib
import enum
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from torch.profiler import record_function

from ds_odc.balancer.sampler import last_drawn
from ds_odc.config import OdcConfig
from ds_odc.ops import make_transport
from ds_odc.ops.lockstep import LockstepTally
from ds_odc.ops.transport import GatherPlan, OdcError, ScatterPlan, Segment, SymmetricBuffer, Transport
from ds_odc.zero.hybrid import HybridGroups, Replicas
from ds_odc.zero.minibatch import MinibatchTag, check_same_minibatch

__all__: list[str] = []

NOT_AVAILABLE, INFLIGHT, AVAILABLE = ZeroParamStatus.NOT_AVAILABLE, ZeroParamStatus.INFLIGHT, ZeroParamStatus.AVAILABLE
_UNPROFILED = contextlib.nullcontext()


def profiled(label: str):
    """A torch profiler range named ``label`` while a profiler records, else nothing. ``record_function`` costs
    14-17 us per use even when no profiler runs (measured on a 2-core CPU host), and fetches and pushes run per block
    and per bucket of every microbatch; this check costs no more than entering an empty ``with`` block."""
    return record_function(label) if torch.autograd._profiler_enabled() else _UNPROFILED


class Phase(enum.Enum):
    """Where this rank's minibatch stands, as far as its gradients go (one field, as FSDP2's ``TrainingState``)."""

    IDLE = enum.auto()  # nothing pushed or declared since the last publish: reading a gradient is local, as stock
    ACCUMULATING = enum.auto()  # pushed or declared its boundary; pushes (own and peers') may still be in flight
    SETTLED = enum.auto()  # completed early (settle): every push so far landed; the next push meets the others first
    DISCARDED = enum.auto()  # zero_grad() after settling: the next push empties the accumulator, then meets
    STEPPING = enum.auto()  # between start_step() and publish(): DeepSpeed's own step is using the gradients


@dataclass(frozen=True)
class ShardPlace:
    """Where one parameter's shard lives: ``numel`` elements at ``offset`` of ``buffer`` on every rank."""

    buffer: SymmetricBuffer
    offset: int
    numel: int
    address: int  # data_ptr of this rank's copy: a ds_tensor somewhere else was replaced behind our back


@dataclass(frozen=True)
class GradPlace:
    """Where one parameter's gradient partition lives in the accumulator."""

    offset: int
    numel: int


@dataclass(frozen=True)
class FetchPlan:
    """One fetch group (the same parameters, fetched together, every step): a transport plan per source buffer, and
    where each parameter's full tensor sits in that plan's output."""

    params: tuple[torch.nn.Parameter, ...]
    reads: tuple[GatherPlan, ...]  # empty at world size 1: parameters are views of the shards themselves
    views: tuple[tuple[int, int], ...]  # per parameter: (read index, offset in that read's output)


class FetchHandle:
    """A started fetch. The reads were enqueued on the current stream when the handle was made (the coordinator's
    fetch stream, which it orders the compute stream after), so waiting only marks the params available."""

    __slots__ = ("params", "done")

    def __init__(self, params: Sequence[torch.nn.Parameter]):
        self.params = params
        self.done = False

    def wait(self, handle_dependency: bool = True, **kwargs) -> None:
        if not self.done:
            for param in self.params:
                param.ds_status = AVAILABLE
            self.done = True


# (mode, at_boundary): mode is "implicit" (gradient_accumulation_steps counts the microbatches: drop-in),
# "explicit" (the caller sets the boundary) or "unmanaged" (step() is the boundary).
Accumulation = Callable[[], tuple[str, bool]]


class OdcState:
    """The ODC half of one engine's ZeRO-3 step (see the module docstring)."""

    def __init__(self, config: OdcConfig, groups: HybridGroups | None = None):
        self.config = config
        self.groups = groups  # None: one shard group holds every rank
        self.replicas: Replicas | None = None
        self.transport: Transport | None = None
        self.shards: dict[int, ShardPlace] = {}
        self.params: dict[int, torch.nn.Parameter] = {}
        self.grads: dict[int, GradPlace] = {}
        self.trainable: SymmetricBuffer | None = None
        self.frozen: list[SymmetricBuffer] = []
        self.accumulator: SymmetricBuffer | None = None
        self.accumulation: Accumulation = lambda: ("implicit", True)
        self.wait_s = 0.0  # time the last step's host waited for peers (fence, publish, lock-step): metrics read it
        self.lockstep = config.lockstep  # meet every rank at every block (a baseline for measuring)
        self.lockstep_step: LockstepTally | None = None  # with lockstep: the last step's meetings and time waited
        self._lockstep_before = LockstepTally()  # the transport's running tally at the last step
        self.phase = Phase.IDLE  # every step publishes exactly once, on every rank, which returns it to IDLE
        self.minibatch: MinibatchTag | None = None  # what the loop says the next step trains (None: untagged)
        self._fetch_plans: dict[tuple[int, ...], FetchPlan] = {}
        self._push_plans: dict[tuple[int, ...], ScatterPlan] = {}
        self.put_away: dict[int, tuple[SymmetricBuffer, torch.Tensor]] = {}  # id(buffer) -> (buffer, its host copy)

    # -- placement (once, while DeepSpeed builds its optimizer) --------------------------------------------------------
    def connect(self, device: torch.device, process_group) -> Transport:
        """Start the transport over ``process_group``: the ranks DeepSpeed partitions over (the shard group)."""
        if self.transport is None:
            if self.groups is None:
                self.transport = make_transport(self.config, device, process_group)
            else:
                self.transport = make_transport(self.config, device, process_group, self.groups.shard_control,
                                                self.groups.job_control)
                self.replicas = Replicas(self.groups, self.config.timeout_s)
        return self.transport

    @property
    def average_over(self) -> int:
        """Every rank's gradient counts 1/W, W the whole job (as the reduce-scatter that pushes replace)."""
        replicas = 1 if self.groups is None else self.groups.layout.replicas
        return self.transport.world_size * replicas

    def sync_replicas(self, buffers: Sequence[SymmetricBuffer] | None = None) -> None:
        """Give every shard group the first group's shards (of ``buffers``, default all; a no-op without hybrid
        sharding)."""
        if self.replicas is not None:
            buffers = [self.trainable, *self.frozen] if buffers is None else buffers
            self.replicas.broadcast_([b.local for b in buffers if b is not None])

    def place_trainable(self, params: Iterable[torch.nn.Parameter], flat: torch.Tensor) -> torch.Tensor:
        """Move DeepSpeed's flat buffer of trainable shards (``lp_param_buffer``) into symmetric memory, at the same
        offsets, and return the symmetric copy for DeepSpeed to use instead."""
        if self.trainable is not None:
            raise NotImplementedError("ds_odc: re-homing parameter shards (offload_states / reload_states) is not "
                                      "supported with ODC")
        self.trainable = self.transport.allocate(flat.numel(), flat.dtype)
        for param in params:
            shard = param.ds_tensor
            offset = (shard.data_ptr() - flat.data_ptr()) // shard.element_size()
            self._move(param, self.trainable, offset)
        return self.trainable.local

    def take_trainable_shards(self, params: Sequence[torch.nn.Parameter], flat: torch.Tensor,
                              process_group) -> torch.Tensor:
        """While DeepSpeed builds its optimizer, right after it made ``flat`` (``lp_param_buffer``) and before anything
        aliases it: start the transport over ``process_group`` where the shards are (with ``offload_optimizer``,
        stock's optimizer device is the CPU, not theirs), move them into symmetric memory (:meth:`place_trainable`),
        and give every shard group the first group's, before stage 3 copies the fp32 master weights from them."""
        self.connect(flat.device, process_group)
        flat = self.place_trainable(params, flat)
        self.sync_replicas([self.trainable])
        return flat

    def place_frozen(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Frozen ZeRO params are not in ``lp_param_buffer``: give them symmetric buffers of their own, per dtype."""
        params = sorted(params, key=lambda p: p.ds_id)
        for dtype in sorted({p.ds_tensor.dtype for p in params}, key=str):
            group = [p for p in params if p.ds_tensor.dtype == dtype]
            buffer = self.transport.allocate(sum(p.ds_tensor.numel() for p in group), dtype)
            offset = 0
            for param in group:
                self._move(param, buffer, offset)
                offset += param.ds_tensor.numel()
            self.frozen.append(buffer)

    def _move(self, param: torch.nn.Parameter, buffer: SymmetricBuffer, offset: int) -> None:
        shard = param.ds_tensor
        view = buffer.local.narrow(0, offset, shard.numel())
        view.copy_(shard.data.reshape(-1))
        shard.data = view.view(shard.shape)
        self.shards[param.ds_id] = ShardPlace(buffer, offset, shard.numel(), view.data_ptr())
        self.params[param.ds_id] = param

    def place_accumulator(self, params: Iterable[torch.nn.Parameter], numel: int) -> dict[int, torch.Tensor]:
        """Allocate the fp32 accumulation partition peers push into (same layout as DeepSpeed's
        ``grad_partitions_flat_buffer``); returns each parameter's view of it. Always fp32: pushes from many
        microbatches and ranks add up there (stock bf16 training would accumulate in bf16)."""
        self.accumulator = self.transport.allocate(numel, torch.float32, accumulator=True)
        views, offset = {}, 0
        for param in params:
            n = param.partition_numel()
            views[param.ds_id] = self.accumulator.local.narrow(0, offset, n)
            self.grads[param.ds_id] = GradPlace(offset, n)
            offset += n
        return views

    def accumulated(self, params: Sequence[torch.nn.Parameter]) -> torch.Tensor | None:
        """The accumulator range that holds exactly the gradient partitions of ``params`` (consecutive, in order),
        or None if they are not one contiguous range."""
        places = [self.grads.get(p.ds_id) for p in params]
        if not places or None in places:
            return None
        end = places[0].offset
        for place in places:
            if place.offset != end:
                return None
            end += place.numel
        return self.accumulator.local.narrow(0, places[0].offset, end - places[0].offset)

    def is_own_shard(self, param: torch.nn.Parameter) -> bool:
        """Whether the gathered ``param`` is a view of its own shard (one rank), which updating the shard updates."""
        return param.numel() == param.ds_tensor.numel() and param.data_ptr() == param.ds_tensor.data_ptr()

    # -- hop one: parameters ------------------------------------------------------------------------------------------
    def fetch(self, params: Iterable[torch.nn.Parameter]) -> FetchHandle:
        """Start reading every listed (partitioned) parameter from its owners, on the current stream."""
        with profiled("ds_odc::fetch"):
            return self._fetch(sorted(params, key=lambda p: p.ds_id))

    def _fetch(self, params: list[torch.nn.Parameter]) -> FetchHandle:
        key = tuple(p.ds_id for p in params)
        plan = self._fetch_plans.get(key)
        if plan is None:
            plan = self._fetch_plans[key] = self._plan_fetch(params)
        for param in plan.params:
            if param.ds_tensor.data_ptr() != self.shards[param.ds_id].address:
                self._adopt_replaced_shards()
                break
        if plan.reads:
            outs = []
            for read in plan.reads:
                out = torch.empty(read.out_numel, dtype=read.source.dtype, device=read.source.local.device)
                self.transport.gather(read, out)
                outs.append(out)
            for param, (i, offset) in zip(plan.params, plan.views):
                param.data = outs[i].narrow(0, offset, param.ds_numel).view(param.ds_shape)
                param.ds_status = INFLIGHT
        else:  # one rank: the shard is the whole parameter
            for param in plan.params:
                place = self.shards[param.ds_id]
                param.data = place.buffer.local.narrow(0, place.offset, param.ds_numel).view(param.ds_shape)
                param.ds_status = INFLIGHT
        return FetchHandle(plan.params)

    def fetch_now(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Read the listed parameters that are partitioned, and wait (``param.all_gather()``)."""
        todo = [p for p in params if p.ds_status == NOT_AVAILABLE]
        if todo:
            self.fetch(todo).wait()

    def fetch_missing(self, params: Iterable[torch.nn.Parameter], stream) -> int:
        """The parameter coordinator's gather, for fetches and prefetches alike: read those of ``params`` that are
        partitioned from their owners on the coordinator's fetch ``stream``; returns the elements read (the coordinator
        counts them). The reads are not registered as in flight: every ``fetch_sub_module`` ends by ordering the
        compute stream after the fetch stream, so the per-parameter wait that registering buys (a stream switch and an
        event per parameter, per block, per microbatch) adds only host time."""
        todo = [p for p in params if p.ds_status == NOT_AVAILABLE]
        if not todo:
            return 0
        with get_accelerator().stream(stream):
            self.fetch(todo).wait()
        return sum(p.ds_numel for p in todo)

    def release_gathered(self, release: Callable[[torch.nn.Parameter], None]) -> None:
        """At the start of the step (nothing in flight: reads are waited where they are issued), release every gathered
        parameter through the coordinator's ``release``. Every ZeRO parameter is listed here already, and a parameter
        that *is* its shard (one rank) is updated in place by the step, so it stays: only the others are released."""
        for param in self.params.values():
            if param.ds_active_sub_modules:
                param.ds_active_sub_modules.clear()
            if param.ds_status != NOT_AVAILABLE and not self.is_own_shard(param):
                release(param)
                if param.ds_status != NOT_AVAILABLE:
                    raise RuntimeError(f"{param.ds_summary()} expected to be released")

    def _plan_fetch(self, params: list[torch.nn.Parameter]) -> FetchPlan:
        for param in params:
            if param.ds_status != NOT_AVAILABLE:
                raise OdcError(f"ds_odc: fetching a parameter that is not partitioned: {param.ds_summary()}")
            if param.ds_id not in self.shards:
                raise OdcError(f"ds_odc: parameter {param.ds_id} has no symmetric shard (was it added to the model "
                               "after deepspeed.initialize?)")
        if self.transport.world_size == 1:
            return FetchPlan(tuple(params), (), ())
        buffers = list({id(self.shards[p.ds_id].buffer): self.shards[p.ds_id].buffer for p in params}.values())
        reads, views = [], [None] * len(params)
        for i, buffer in enumerate(buffers):
            members = [j for j, p in enumerate(params) if self.shards[p.ds_id].buffer is buffer]
            segments = [Segment(self.shards[params[j].ds_id].offset, self.shards[params[j].ds_id].numel)
                        for j in members]
            read = self.transport.plan_gather(buffer, segments)
            for j, out_offset in zip(members, read.out_offsets):
                views[j] = (i, out_offset)
            reads.append(read)
        return FetchPlan(tuple(params), tuple(reads), tuple(views))

    # -- hop two: gradients -------------------------------------------------------------------------------------------
    def push(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Add every parameter's gradient, slice by slice, into its owners' accumulators, averaged over the ranks (as
        the reduce-scatter it replaces)."""
        if self.phase in (Phase.SETTLED, Phase.DISCARDED):
            self._release_pushes()
        with profiled("ds_odc::push"):
            key = tuple(p.ds_id for p in params)
            plan = self._push_plans.get(key)
            if plan is None:
                segments = [Segment(self.grads[p.ds_id].offset, self.grads[p.ds_id].numel) for p in params]
                plan = self._push_plans[key] = self.transport.plan_scatter(self.accumulator, segments,
                                                                           [p.ds_numel for p in params])
            self.transport.scatter_accumulate(plan, [p.grad.reshape(-1) for p in params],
                                              scale=1.0 / self.average_over)
        if self.phase is not Phase.STEPPING:
            self.phase = Phase.ACCUMULATING

    def free_pushed_gradients(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Free the full gradients of a pushed bucket (once the stream that pushes them has read them): the pushes went
        to the owners, so nothing is copied into a local partition."""
        stream = get_accelerator().current_stream()  # None where the device has no streams (CPU)
        for param in params:
            if param.grad is not None and stream is not None:
                param.grad.record_stream(stream)
            param.grad = None

    def meet_lockstep(self, what: str) -> None:
        """With ``odc.lockstep``: meet every rank (``what`` names the meeting in errors), on the current stream."""
        with profiled("ds_odc::lockstep"):
            self.transport.lockstep_barrier(what)

    def declare_boundary(self) -> None:
        """This rank reached the end of its minibatch (possibly with no microbatch at all): from now on it takes part
        in early gradient reads (:meth:`settle`) as a rank that pushed does."""
        if self.phase is Phase.IDLE:
            self.phase = Phase.ACCUMULATING

    # -- hop three: the step ------------------------------------------------------------------------------------------
    def tag_minibatch(self, tag: MinibatchTag) -> None:
        """The minibatch the next optimizer step trains, as this rank's loop sees it (checked at that step)."""
        self.minibatch = tag

    def fence(self, what: str = "the fence at the optimizer step",
              note: str | None = None) -> dict[int, str | None] | None:
        """Meet every rank; afterwards every push issued before any rank arrived is in the accumulator (with hybrid
        sharding: summed over every shard group). ``note``: posted with the arrival; every rank's note is returned
        (:class:`~ds_odc.ops.meeting.Meeting`)."""
        started = time.perf_counter()
        with profiled("ds_odc::fence"):
            if self.replicas is not None:
                notes = self.replicas.meet(what, note)  # the whole job: names a missing rank in any group, everywhere
                self.transport.fence([self.accumulator], what)
                self.replicas.sum_(self.accumulator.local)
            else:
                notes = self.transport.fence([self.accumulator], what, note)
        self.wait_s += time.perf_counter() - started
        if self.phase is Phase.ACCUMULATING:
            self.phase = Phase.SETTLED
        return notes

    def publish(self) -> None:
        """Empty the accumulator and meet the other ranks, so that nobody reads a shard before its owner updated it
        or pushes into an accumulator before its owner emptied it."""
        with profiled("ds_odc::publish"):
            self.transport.zero_([self.accumulator])
            if self.replicas is not None:
                self.replicas.reset()
            started = time.perf_counter()
            self.transport.barrier("the barrier after the optimizer step")
            self.wait_s += time.perf_counter() - started
        self.phase = Phase.IDLE

    def start_step(self) -> None:
        """The optimizer step begins with its fence, where the ranks also check they step the same minibatch (when
        the loop tagged it); from here to :meth:`publish` DeepSpeed's step uses the gradients."""
        self.wait_s = 0.0
        self.phase = Phase.STEPPING
        tag, self.minibatch = self.minibatch, None
        if tag is None:  # the loop did not tag: the minibatch its sampler drew last, if it iterates one
            tag = MinibatchTag.of(last_drawn())
        notes = self.fence("the fence at the optimizer step", note=None if tag is None else tag.encode())
        if notes is not None:
            check_same_minibatch(notes, dist.get_rank())
        if self.lockstep:
            self._take_lockstep_step()

    def _take_lockstep_step(self) -> None:
        """This step's share of the transport's lock-step tally (up to date after the fence); the host's waiting in
        those meetings counts in :attr:`wait_s` (the device's, on CUDA, overlaps its other streams: not counted)."""
        now, before = self.transport.lockstep_tally, self._lockstep_before
        self.lockstep_step = LockstepTally(now.meetings - before.meetings, now.wait_s - before.wait_s, now.on_device)
        self._lockstep_before = LockstepTally(now.meetings, now.wait_s, now.on_device)
        if not now.on_device:
            self.wait_s += self.lockstep_step.wait_s

    # -- gradients and shards touched outside the step (stock semantics) ---------------------------------------------
    def settle(self, why: str) -> None:
        """Before a gradient of this minibatch is read or written ahead of the step: land every push now. Stock ZeRO-3
        reduces after each backward; ODC meets only at the step, so a read in between meets early, on every rank."""
        if self.phase is not Phase.ACCUMULATING:
            return  # nothing pushed since the step, it all landed already, or the step is on: local, as stock
        mode, at_boundary = self.accumulation()
        if mode == "unmanaged":
            raise OdcError(f"ds_odc: {why} between backward() and step() with managed_gradient_accumulation=false: "
                           "ranks may run different numbers of microbatches, so this rank cannot know the others' "
                           "gradients are complete. Read gradients after engine.step() (e.g. "
                           "engine.get_global_grad_norm()), or use managed accumulation and read them on every rank "
                           "after set_gradient_accumulation_boundary(True) and the last backward.")
        if mode == "explicit" and not at_boundary:
            raise OdcError(f"ds_odc: {why} in the middle of a minibatch: with explicit accumulation boundaries ranks "
                           "may run different numbers of microbatches, so the gradients of this minibatch exist only "
                           "once every rank has reached its boundary. Do it on every rank after "
                           "set_gradient_accumulation_boundary(True) and the last backward, or after engine.step().")
        self.fence(f"completing this minibatch's gradients early for {why} (every rank must do it)")
        # The caller reads or writes the gradients after this returns; a fast peer's next microbatch must not land
        # in them meanwhile (on a GPU pushes add straight into the accumulator), so pushes wait for one more meeting
        # (the fence left the phase SETTLED: see _release_pushes).

    def settled_on_read(self, gradients: dict) -> dict:
        """``gradients`` (stock's ``averaged_gradients``) as a dict whose reads land this minibatch's pushes first
        (:meth:`settle`); writing an entry does not."""
        return SettlingDict(gradients, self.settle)

    def discard(self, why: str) -> None:
        """``optimizer.zero_grad()`` before the step, on every rank: as stock, the gradients so far stay readable (and
        a step taken now still applies them) until the next backward replaces them. Stock's step calls it too, after
        the gradients were taken, which must drop nothing."""
        if self.phase in (Phase.IDLE, Phase.STEPPING):
            return
        self.settle(why)
        self.phase = Phase.DISCARDED

    def _release_pushes(self) -> None:
        """The first push after gradients were completed early (``settle``) or dropped (``discard``): empty the
        accumulator if they were dropped, then meet, so that no peer's push of the next microbatch lands before every
        rank is done with the gradients so far (read, written, or emptied). With hybrid sharding the gradients so far
        (summed over the replicas early, perhaps written since) are kept aside unless dropped: the step sums only
        what is pushed from now on."""
        if self.replicas is not None:
            self.replicas.resume(self.accumulator.local, dropped=self.phase is Phase.DISCARDED)
        if self.phase is Phase.DISCARDED:
            self.transport.zero_([self.accumulator])
        self.transport.barrier("the first gradient push after gradients were read, written or dropped before the "
                               "step (every rank must do it)")

    def publish_writes(self, why: str) -> None:
        """Shards were written outside the step (on every rank): meet, so peers read the new values (with hybrid
        sharding, the first shard group's, as stock takes a modifier's write from rank 0)."""
        self.sync_replicas()
        self.transport.barrier(f"publishing parameters written by {why} (every rank must do it)")

    def _adopt_replaced_shards(self) -> None:
        """Someone assigned ``param.ds_tensor.data = new`` after ``deepspeed.initialize``: peers read shards from
        symmetric memory, so copy every replaced shard there, point ``ds_tensor`` back at it, and meet."""
        if any(buf is not self.accumulator for buf, _ in self.put_away.values()):
            raise OdcError("ds_odc: the parameter shards were put away by engine.offload_states(); call "
                           "engine.reload_states() on every rank before the next forward")
        for place, param in self._replaced():
            view = place.buffer.local.narrow(0, place.offset, place.numel)
            view.copy_(param.ds_tensor.data.reshape(-1))
            param.ds_tensor.data = view.view(param.ds_tensor.shape)
        self.publish_writes("assigning param.ds_tensor.data after deepspeed.initialize")

    def _replaced(self):
        for ds_id, place in self.shards.items():
            param = self.params[ds_id]
            if param.ds_tensor.data_ptr() != place.address:
                if param.ds_tensor.numel() != place.numel:
                    raise OdcError(f"ds_odc: parameter {ds_id}'s ds_tensor was replaced by one of "
                                   f"{param.ds_tensor.numel()} elements; its shard has {place.numel}")
                yield place, param

    def check_shards_in_place(self, params: Iterable[torch.nn.Parameter]) -> None:
        """After a checkpoint load: every shard must still be in symmetric memory (peers read it there)."""
        for param in params:
            if param.ds_tensor.data_ptr() != self.shards[param.ds_id].address:
                raise OdcError("ds_odc: a checkpoint load moved parameter shards out of symmetric memory; this "
                               "DeepSpeed version is not supported with ODC")

    # -- states put away (DeepSpeed's offload_states / reload_states) -------------------------------------------------
    def shard_buffers(self) -> list[SymmetricBuffer]:
        """Every buffer of parameter shards (trainable, then frozen)."""
        return [b for b in [self.trainable, *self.frozen] if b is not None]

    def put_away_buffers(self, buffers: Sequence[SymmetricBuffer], pin: Callable[[torch.Tensor], torch.Tensor],
                         why: str) -> None:
        """Move the contents of ``buffers`` to host copies (``pin`` makes an empty host tensor page-locked, or not),
        point every parameter whose shard is in one of them at its host copy, and give the symmetric memory back.
        Every rank calls it (``why``: the call, for the error naming a rank that does not): the ranks meet first, so
        nobody reads a shard or pushes a gradient into memory being given back; a minibatch's gradients so far are
        landed first (as a gradient read would, see :meth:`settle`)."""
        if not self.transport.can_evict:
            raise OdcError(f"ds_odc: the {self.transport.name} transport cannot give symmetric memory back")
        if self.accumulator in buffers:
            self.settle(why)
        self.transport.barrier(f"{why} (every rank must call it)")
        for buf in buffers:
            host = pin(torch.empty(buf.numel, dtype=buf.dtype, device="cpu"))
            host.copy_(buf.local)
            self.put_away[id(buf)] = (buf, host)
        self._point_shards(lambda buf: self.put_away.get(id(buf), (None, None))[1])
        self.transport.evict(list(buffers))

    def host_copy(self, buffer: SymmetricBuffer) -> torch.Tensor | None:
        """The host copy of a buffer put away, else None."""
        return self.put_away.get(id(buffer), (None, None))[1]

    def bring_back(self, why: str) -> None:
        """Copy every buffer put away back into its symmetric memory, point the parameters at their shards there
        again, and meet: peers read (and push into) it only after every rank has brought its own back."""
        for buf, host in self.put_away.values():
            buf.local.copy_(host)
        self._point_shards(lambda buf: buf.local if id(buf) in self.put_away else None)
        self.put_away.clear()
        self.transport.barrier(f"{why} (every rank must call it)")

    def _point_shards(self, flat_of: Callable[[SymmetricBuffer], torch.Tensor | None]) -> None:
        for ds_id, place in self.shards.items():
            flat = flat_of(place.buffer)
            if flat is not None:
                shard = self.params[ds_id].ds_tensor
                shard.data = flat.narrow(0, place.offset, place.numel).view(shard.shape)

    def leave(self, why: str) -> None:
        """This rank will not meet again (its engine is gone): a meeting the others wait in says so."""
        if self.transport is not None:
            self.transport.leave(why)
        if self.replicas is not None:
            self.replicas.leave(why)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class SettlingDict(dict):
    """A dict whose reads call ``settle`` first (:meth:`OdcState.settled_on_read`); writes do not."""

    def __init__(self, values, settle: Callable[[str], None]):
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
