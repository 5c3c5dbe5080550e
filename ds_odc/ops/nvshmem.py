"""NVSHMEM transport: ODC's one-sided gather and scatter-accumulate between GPUs.

Every symmetric buffer is one ``nvshmem_malloc`` allocation, so a peer's copy of ``offset`` is reachable either as
a plain pointer (NVLink peers: ``nvshmem_ptr``) or through NVSHMEM's RMA calls (any peer, including other nodes).
Two paths, chosen once per transport:

* **peer-pointer path** (default when every peer is load/store reachable): gather = copy-engine reads straight from
  the owners' memory (``cudaMemcpyAsync`` over NVLink); scatter-accumulate = fp32 vector reductions
  (``red.add.v4.f32``) into the owners' accumulators from one kernel per call. No staging memory; the order in which
  sources' contributions are summed is not fixed (fp32 rounding may differ run to run). ``"deterministic": true``
  (``scatter_method="staging"``) trades (W-1) x accumulator memory for bit-reproducible sums (single-writer slots, summed in source order).
* **RMA path** (``force_remote_path=True``, or automatically when some peer is not P2P-reachable): gather =
  ``nvshmemx_getmem_on_stream``; scatter-accumulate = a kernel that, for each chunk, gets this source's private
  staging slot on the owner, adds the gradient, and puts it back. Slots have a single writer, so no float atomics
  cross the network (NVSHMEM 3.4 has none); the owner adds the slots into its accumulator at the fence, in source
  order. Costs (W-1) x the accumulator in staging memory.

The fence: finish this rank's pushes (``quiet`` + device sync), meet everyone (``ds_odc.ops.meeting``: times out and
names ranks that do not arrive), then drain staging slots where there are any.

Lock-step meetings (``odc.lockstep``, a baseline for measuring; :mod:`ds_odc.ops.lockstep`): on the peer-pointer
path, a one-CTA kernel on the current stream (``odc_lockstep_barrier``): it adds one to this rank's counter in every
peer's copy of a small symmetric array, then waits until its own copy shows every rank's counter at this meeting's
number, or until ``timeout_s`` has passed on the device clock; then it marks the ranks still missing in a small
device array and returns, and the meetings after it do not wait. The next fence or barrier, after its device sync,
reads that array and raises :class:`FenceTimeout` naming them. On the RMA path (no peer pointers) a lock-step meeting
is a device sync and a host meeting instead: correct, but slower than any collective, so no baseline for speed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist

from ds_odc.ops.lockstep import HostLockstep, LockstepTally, fewer_microbatches
from ds_odc.ops.meeting import Meeting
from ds_odc.ops.nvshmem_runtime import ensure_runtime
from ds_odc.ops.transport import (FenceTimeout, GatherPlan, OdcError, ScatterPlan, Segment, SymmetricBuffer,
                                  Transport, out_layout)

__all__ = ["NvshmemTransport"]

_SRC_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_P2P_MODES = {"atomic-scalar": 0, "atomic": 1, "staging": 2}  # odc_scatter_add_p2p's modes
_RMA_CTAS = 264  # device-initiated transfers need many CTAs in flight (2 per SM on H100/H200)
_MIN_ALLOC = 512  # nvshmem_malloc(0) returns NULL; keep every buffer addressable
_TASK_FIELDS = 6  # int64 fields of csrc's Task record: dst, src, n, first (set by the launcher), pe, padding


class _Allocation:
    """One symmetric allocation and this rank's view of every peer's copy."""

    def __init__(self, transport: "NvshmemTransport", nbytes: int):
        self.ptr = transport._malloc(nbytes)
        self.nbytes = nbytes
        # 0 where the peer is not load/store reachable; the peer-pointer path is only taken when none is 0
        self.peer = [transport.lib.peer_ptr(self.ptr, pe) if pe != transport.my_pe else self.ptr
                     for pe in transport.pes]


@dataclass(eq=False)
class NvshmemBuffer(SymmetricBuffer):
    data: _Allocation | None = None
    staging: _Allocation | None = None  # accumulators that stage: (W-1) single-writer slots of numel fp32 each
    staging_view: torch.Tensor | None = None  # (W-1, numel) float32: slot s holds source slot_source[s]'s pushes


@dataclass(eq=False)
class NvshmemGatherPlan(GatherPlan):
    """Byte offsets into the output, source addresses, sizes and PEs of every (segment, owner) read."""

    dst_offsets: np.ndarray = field(default=None)
    src: np.ndarray = field(default=None)
    nbytes: np.ndarray = field(default=None)
    pes: np.ndarray = field(default=None)
    dst: np.ndarray = field(default=None)  # filled per call: output address + dst_offsets


@dataclass(eq=False)
class NvshmemScatterPlan(ScatterPlan):
    """The task table of every (segment, owner) slice that exists, complete but for the source addresses."""

    tasks: np.ndarray = field(default=None)  # [tasks, 6] int64
    input_index: np.ndarray = field(default=None)  # which input each task reads
    src_offsets: np.ndarray = field(default=None)  # byte offset of the task's slice in its input
    src_itemsize: int = 0


def _tensor_at(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over this GPU's symmetric memory (torch does not own it and never frees it).

    Only for local addresses: torch files a pointer under the device that physically holds it, so a peer pointer
    would come back as a copy on the peer's device. Peers are written by our kernels only."""

    class _Cuda:
        __cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3,
                                    "strides": None}

    view = torch.as_tensor(_Cuda(), device=device)
    if view.data_ptr() != ptr:
        raise OdcError(f"ds_odc: symmetric memory at {ptr:#x} was copied instead of viewed ({view.device})")
    return view


class NvshmemTransport(Transport):
    name = "nvshmem"

    def __init__(self, process_group=None, timeout_s: float = 300.0, force_remote_path: bool = False,
                 scatter_method: str = "atomic", bootstrap: str = "auto", control=None, job_control=None,
                 lockstep: bool = False):
        """``scatter_method`` (peer-pointer path only): "atomic" (vector fp32 reductions), "atomic-scalar", or
        "staging" (deterministic: read-modify-write of per-source slots through peer views; the ``deterministic``
        config key). The RMA path always stages. ``bootstrap``: how NVSHMEM comes up (see nvshmem_runtime).

        ``process_group`` may be part of the job (a shard group): reads and pushes then reach only its ranks, while
        NVSHMEM's own collective calls (bring-up, every allocation) still span every process, so every rank of the
        job allocates the same buffers in the same order, and what decides their sizes is agreed over
        ``job_control`` (a gloo group over every rank; ``control``: one over ``process_group``'s ranks).
        ``lockstep``: take part in lock-step meetings (``odc.lockstep``; see the module docstring)."""
        self.meet = Meeting(process_group, timeout_s, control)
        super().__init__(self.meet.rank, self.meet.world_size, timeout_s)
        if not torch.cuda.is_available():
            raise OdcError("ds_odc: the nvshmem transport needs CUDA; set zero_optimization.odc.transport to 'shm'.")
        if self.world_size == dist.get_world_size():
            self.job = self.meet.group
        elif job_control is not None or dist.get_backend() == "gloo":
            self.job = job_control  # None: the default group, gloo already
        else:
            raise OdcError("ds_odc: an nvshmem transport over part of the job needs a gloo group over the whole job "
                           "(job_control): NVSHMEM's allocations are collective over every process")
        self.device = torch.device("cuda", torch.cuda.current_device())
        # NVSHMEM numbers PEs as the job numbers ranks: rank r of this group is PE pes[r]
        self.pes = list(self.meet.job_ranks)
        self.force_remote_path = force_remote_path
        if scatter_method not in _P2P_MODES:
            raise OdcError(f"ds_odc: scatter method {scatter_method!r}; use one of {sorted(_P2P_MODES)}")
        self.scatter_method = scatter_method
        self.bootstrap = bootstrap
        self.lib = None
        self.my_pe = None
        self.remote = force_remote_path  # decided for good at the first allocation
        self._allocations: list[_Allocation] = []
        self._scratch: _Allocation | None = None
        self._scratch_done: torch.cuda.Event | None = None
        self._broken = False
        self.symmetric_bytes = 0  # everything this transport holds in the symmetric heap
        self.lockstep_tally = LockstepTally() if lockstep else None
        self._lockstep: _DeviceLockstep | HostLockstep | None = None  # chosen with the path, at the first allocation

    # -- bring-up and allocation --------------------------------------------------------------------------------------
    def _start(self, first_bytes: int) -> None:
        runtime = ensure_runtime(self.job, first_bytes, self.bootstrap)
        self.lib, self.my_pe = runtime.lib, runtime.my_pe
        if not self.remote:
            # Probe reachability once; every rank of the job must take the same path (it decides which buffers are
            # allocated, and allocations are collective over the job), so agree on it.
            probe = _Allocation(self, _MIN_ALLOC)
            self._allocations.append(probe)
            reachable = torch.tensor([int(all(probe.peer))], dtype=torch.int32)
            dist.all_reduce(reachable, op=dist.ReduceOp.MIN, group=self.job)
            self.remote = not bool(reachable.item())
        self._rma_chunk = self.lib.rma_chunk_elems()
        if self.lockstep_tally is not None:  # every rank allocates the same (allocations are collective)
            if self.remote:
                self._lockstep = HostLockstep(self.meet)
                self.lockstep_tally = self._lockstep.tally
            else:
                self._lockstep = _DeviceLockstep(self)
                self.lockstep_tally.on_device = True

    def _malloc(self, nbytes: int) -> int:
        # Agree that everyone can afford it before the collective malloc: a rank failing alone would hang the others.
        free, _ = torch.cuda.mem_get_info(self.device)
        ok = torch.tensor([int(nbytes <= free)], dtype=torch.int32)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.job)
        ptr = self.lib.malloc(nbytes) if ok.item() else 0
        if not ptr:
            raise OdcError(
                f"ds_odc: rank {self.rank}: NVSHMEM could not allocate {nbytes / 2**20:.1f} MiB of symmetric memory "
                f"({self.symmetric_bytes / 2**20:.1f} MiB held by ds_odc, {free / 2**20:.1f} MiB free on the GPU here). "
                "The heap grows on demand up to NVSHMEM_MAX_MEMORY_PER_GPU (default 128 GiB); raise it, or set "
                "NVSHMEM_SYMMETRIC_SIZE to the total if NVSHMEM_DISABLE_CUDA_VMM=1 (fixed heap), or free GPU memory.")
        self.symmetric_bytes += nbytes
        return ptr

    def allocate(self, numel: int, dtype: torch.dtype, *, accumulator: bool = False) -> NvshmemBuffer:
        if accumulator and dtype != torch.float32:
            raise OdcError(f"ds_odc: accumulators are float32 on the nvshmem transport, not {dtype}")
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = max(numel * itemsize, _MIN_ALLOC)
        if self.lib is None:
            guess = nbytes * (self.world_size if accumulator and self.remote else 1)
            self._start(guess)
        data = _Allocation(self, nbytes)
        self._allocations.append(data)
        staging = staging_view = None
        if accumulator and self._stages():
            staging = _Allocation(self, max((self.world_size - 1) * numel * 4, _MIN_ALLOC))
            self._allocations.append(staging)
            staging_view = _tensor_at(staging.ptr, staging.nbytes, self.device)[:(self.world_size - 1) * numel * 4]
            staging_view = staging_view.view(torch.float32).view(self.world_size - 1, numel).zero_()
        if accumulator and self.remote and self._scratch is None:
            self._scratch = _Allocation(self, _RMA_CTAS * self._rma_chunk * 4)
            self._allocations.append(self._scratch)
        local = _tensor_at(data.ptr, nbytes, self.device)[:numel * itemsize].view(dtype).zero_()
        buf = NvshmemBuffer(numel, dtype, local, accumulator, data=data, staging=staging, staging_view=staging_view)
        # Zeros must land everywhere before any peer reads or pushes.
        torch.cuda.synchronize(self.device)
        self.meet("symmetric allocation")
        return buf

    def _stages(self) -> bool:
        return self.remote or self.scatter_method == "staging"

    def _slot(self, source: int, owner: int) -> int:
        """Index of ``source``'s staging slot on ``owner`` (owners keep no slot for themselves)."""
        return source if source < owner else source - 1

    def _owner_order(self) -> list[int]:
        """Owners starting with the next rank, so that concurrent callers do not all hit rank 0 first."""
        return [(self.rank + k) % self.world_size for k in range(1, self.world_size + 1)]

    # -- gather ---------------------------------------------------------------------------------------------------------
    def plan_gather(self, source: NvshmemBuffer, segments: Sequence[Segment]) -> NvshmemGatherPlan:
        segments = tuple(segments)
        out_offsets, total = out_layout(segments, self.world_size)
        itemsize = source.local.element_size()
        lengths = np.fromiter((s.length for s in segments), np.int64, len(segments))
        offsets = np.fromiter((s.offset for s in segments), np.int64, len(segments))
        outs = np.asarray(out_offsets, np.int64)
        dst, src, pes = [], [], []
        for r in self._owner_order():  # W ranks gathering at once spread their reads over all owners
            base = source.data.ptr if self.remote else source.data.peer[r]
            dst.append((outs + r * lengths) * itemsize)
            src.append(base + offsets * itemsize)
            pes.append(np.full(len(segments), self.pes[r], np.int64))
        nbytes = np.tile(lengths * itemsize, self.world_size)
        keep = nbytes > 0
        dst, src, pes = (np.ascontiguousarray(np.concatenate(a)[keep]) for a in (dst, src, pes))
        return NvshmemGatherPlan(source, segments, out_offsets, total, dst_offsets=dst, src=src,
                                 nbytes=np.ascontiguousarray(nbytes[keep]), pes=pes, dst=np.empty_like(dst))

    def gather(self, plan: NvshmemGatherPlan, out: torch.Tensor) -> None:
        if len(plan.src) == 0:
            return
        if out.dtype != plan.source.dtype or not out.is_contiguous() or out.numel() < plan.out_numel:
            raise OdcError(f"ds_odc: gather output must be contiguous {plan.source.dtype} of {plan.out_numel} "
                           f"elements, got {out.dtype} {tuple(out.shape)}")
        np.add(plan.dst_offsets, out.data_ptr(), out=plan.dst)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        if self.remote:
            self.lib.get_batch(plan.dst.ctypes.data, plan.src.ctypes.data, plan.nbytes.ctypes.data,
                               plan.pes.ctypes.data, len(plan.dst), stream)
        else:
            self.lib.copy_batch(plan.dst.ctypes.data, plan.src.ctypes.data, plan.nbytes.ctypes.data, len(plan.dst),
                                stream)

    # -- scatter-accumulate ---------------------------------------------------------------------------------------------
    def plan_scatter(self, accumulator: NvshmemBuffer, segments: Sequence[Segment],
                     input_numels: Sequence[int]) -> NvshmemScatterPlan:
        segments, numels = tuple(segments), tuple(int(n) for n in input_numels)
        if not self.remote and accumulator.staging is None and self.scatter_method == "staging":
            raise OdcError("ds_odc: this accumulator was allocated without staging slots; choose scatter_method "
                           "'staging' before allocating it")
        targets = self._rma_targets(accumulator) if self.remote else self._p2p_targets(accumulator)
        lengths = np.fromiter((s.length for s in segments), np.int64, len(segments))
        offsets = np.fromiter((s.offset for s in segments), np.int64, len(segments))
        sizes = np.asarray(numels, np.int64)
        blocks, index, starts = [], [], []
        for r in self._owner_order():
            n = np.minimum(lengths, sizes - r * lengths)
            keep = n > 0
            rows = np.zeros((int(keep.sum()), _TASK_FIELDS), np.int64)
            rows[:, 0] = targets[r] + offsets[keep] * 4
            rows[:, 2] = n[keep]
            rows[:, 4] = self.pes[r]
            blocks.append(rows)
            index.append(np.nonzero(keep)[0])
            starts.append(r * lengths[keep])
        return NvshmemScatterPlan(accumulator, segments, numels, tasks=np.ascontiguousarray(np.concatenate(blocks)),
                                  input_index=np.concatenate(index), src_offsets=np.concatenate(starts))

    def scatter_accumulate(self, plan: NvshmemScatterPlan, inputs: Sequence[torch.Tensor], scale: float = 1.0) -> None:
        tasks = plan.tasks
        if len(tasks) == 0:
            return
        dtype = inputs[0].dtype
        if dtype not in _SRC_DTYPES:
            raise OdcError(f"ds_odc: scatter_accumulate inputs must be one of {list(_SRC_DTYPES)}, got {dtype}")
        ptrs = np.fromiter((t.data_ptr() for t in inputs), np.int64, len(inputs))
        np.add(ptrs[plan.input_index], plan.src_offsets * inputs[0].element_size(), out=tasks[:, 1])
        stream = torch.cuda.current_stream(self.device)
        if self.remote:
            if self._scratch_done is not None:  # one scratch area: launches from different streams must not overlap
                stream.wait_event(self._scratch_done)
            self.lib.scatter_add_rma(tasks.ctypes.data, len(tasks), _SRC_DTYPES[dtype], float(scale),
                                     self._scratch.ptr, _RMA_CTAS, stream.cuda_stream)
            self._scratch_done = torch.cuda.Event()
            self._scratch_done.record(stream)
        else:
            self.lib.scatter_add_p2p(tasks.ctypes.data, len(tasks), _SRC_DTYPES[dtype], float(scale),
                                     _P2P_MODES[self.scatter_method], stream.cuda_stream)

    def _p2p_targets(self, acc: NvshmemBuffer) -> list[int]:
        """Per owner rank, the address (through peer pointers) that element 0 of this rank's pushes lands on."""
        if acc.staging is None:  # reductions straight into every owner's accumulator
            return list(acc.data.peer)
        # single-writer slots on the others; our own slice goes straight into acc.local, which only we write
        slot_bytes = acc.numel * 4
        return [acc.data.ptr if r == self.rank else acc.staging.peer[r] + self._slot(self.rank, r) * slot_bytes
                for r in range(self.world_size)]

    def _rma_targets(self, acc: NvshmemBuffer) -> list[int]:
        """Per owner rank, the symmetric address of our slot there (our own slice: the accumulator itself)."""
        slot_bytes = acc.numel * 4
        return [acc.data.ptr if r == self.rank else acc.staging.ptr + self._slot(self.rank, r) * slot_bytes
                for r in range(self.world_size)]

    # -- synchronisation ------------------------------------------------------------------------------------------------
    def _complete_local_work(self) -> None:
        if self.lib is not None and self.remote:
            self.lib.quiet_on_stream(torch.cuda.current_stream(self.device).cuda_stream)
        torch.cuda.synchronize(self.device)  # every stream: pushes issued on the reduce stream are covered too
        if isinstance(self._lockstep, _DeviceLockstep):
            try:
                self._lockstep.check()  # a lock-step meeting that timed out since the last sync raises here
            except BaseException:
                self._broken = True
                raise

    def _arrive(self, what: str, note: str | None = None) -> dict[int, str | None] | None:
        try:
            if isinstance(self._lockstep, HostLockstep):  # see [Note: a lock-step meeting that meets the fence]
                return self._lockstep.meeting(what, note)
            return self.meet(what, note=note)
        except FenceTimeout as err:
            self._broken = True  # peers may be gone: never enter another collective NVSHMEM call (it would hang)
            if isinstance(self._lockstep, _DeviceLockstep):
                self._lockstep.explain(err, what)
            raise
        except BaseException:
            self._broken = True
            raise

    def lockstep_barrier(self, what: str) -> None:
        if self.lockstep_tally is None:
            super().lockstep_barrier(what)
        elif self.world_size > 1 and self._lockstep is not None:  # None: nothing allocated yet, nothing to meet over
            if isinstance(self._lockstep, HostLockstep):
                self._complete_local_work()
            try:
                self._lockstep(what)
            except BaseException:
                self._broken = True
                raise

    def fence(self, accumulators: Sequence[NvshmemBuffer], what: str = "the fence at the optimizer step",
              note: str | None = None) -> dict[int, str | None] | None:
        self._complete_local_work()
        notes = self._arrive(what, note)
        for acc in accumulators:
            slots = acc.staging_view
            if slots is None:
                continue
            for s in range(slots.shape[0]):  # fixed source order: bit-reproducible sums
                acc.local.add_(slots[s])
            slots.zero_()
        return notes

    def barrier(self, what: str = "the barrier after the optimizer step") -> None:
        # Zeroed accumulators and updated shards must be in memory before any peer pushes or reads again.
        self._complete_local_work()
        self._arrive(what)

    def leave(self, why: str) -> None:
        self.meet.leave(why)

    def close(self) -> None:
        if self.lib is None:
            return
        torch.cuda.synchronize(self.device)
        if not self._broken:
            for alloc in reversed(self._allocations):  # nvshmem_free is collective: same order everywhere
                self.lib.free(alloc.ptr)
        self._allocations.clear()
        self._scratch = None
        self.symmetric_bytes = 0
        self.lib = None


class _DeviceLockstep:
    """Lock-step meetings on the peer-pointer path: the ``odc_lockstep_barrier`` kernel (see the module docstring).

    ``counts`` is symmetric: entry ``s`` of rank ``r``'s copy counts the lock-step meetings that rank ``s`` has reached
    (incremented by rank ``s``'s kernels through peer pointers); ``stats`` is this rank's alone: the nanoseconds its
    kernels waited, whether one timed out, and per rank whether it was missing then."""

    def __init__(self, transport: NvshmemTransport):
        world = transport.world_size
        self.transport = transport
        self.tally = transport.lockstep_tally
        self.counts = _Allocation(transport, max(world * 8, _MIN_ALLOC))
        transport._allocations.append(self.counts)
        # zeroed before the allocation's own sync and meeting (NvshmemTransport.allocate), so before any peer adds
        self.local = _tensor_at(self.counts.ptr, world * 8, transport.device).view(torch.int64).zero_()
        self.peers = torch.tensor(self.counts.peer, dtype=torch.int64, device=transport.device)
        self.stats = torch.zeros(2 + world, dtype=torch.int64, device=transport.device)
        self.timeout_ns = int(transport.timeout_s * 1e9)
        self.reached = 0  # lock-step meetings this rank has launched

    def __call__(self, what: str) -> None:
        t = self.transport
        self.reached += 1
        self.tally.meetings += 1
        t.lib.lockstep_barrier(self.peers.data_ptr(), self.counts.ptr, t.world_size, t.rank, self.reached,
                               self.timeout_ns, self.stats.data_ptr(), torch.cuda.current_stream(t.device).cuda_stream)

    def check(self) -> None:
        """After a device sync: take the time waited, and raise :class:`FenceTimeout` if a meeting timed out."""
        stats = self.stats.tolist()
        self.tally.wait_s = stats[0] / 1e9
        if not stats[1]:
            return
        ranks = self.transport.meet.job_ranks
        missing = [ranks[q] for q in range(len(ranks)) if stats[2 + q]]
        me = ranks[self.transport.rank]
        raise FenceTimeout(
            f"ds_odc: rank {me}: a lock-step meeting (zero_optimization.odc.lockstep) did not complete within "
            f"{self.transport.timeout_s:g} s: {missing} did not arrive ({self._seen()}). With lockstep every rank "
            "must run the same number of microbatches per optimizer step, as under stock ZeRO-3: a rank that ran "
            "fewer, stopped or died does not come. Look at the logs of those ranks; if their microbatch is "
            "legitimately longer, raise zero_optimization.odc.timeout_s.", missing)

    def explain(self, err: FenceTimeout, what: str) -> None:
        """A host meeting timed out: if peers have reached more lock-step meetings than this rank, this rank left its
        minibatch early; say so, naming it (raises :class:`~ds_odc.ops.lockstep.LockstepMismatch`)."""
        counts = self.local.tolist()
        ahead = [self.transport.meet.job_ranks[q] for q, n in enumerate(counts) if n > self.reached]
        if ahead:
            me = self.transport.meet.job_ranks[self.transport.rank]
            raise fewer_microbatches(me, what, [me], f"{ahead} had reached more lock-step meetings than this rank "
                                                     f"({self._seen()})") from err

    def _seen(self) -> str:
        ranks = self.transport.meet.job_ranks
        counts = self.local.tolist()
        return "lock-step meetings reached, as seen here: " + ", ".join(
            f"rank {ranks[q]}: {counts[q]}" for q in range(len(ranks))) + f"; this rank launched {self.reached}"
