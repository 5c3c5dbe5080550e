"""Shared-memory transport: the ranks of one host map each other's buffers (CPU training and tests).

Every symmetric buffer is one file per rank under ``/dev/shm``, mapped by every rank, so a gather is a plain copy
out of a peer's mapping. Accumulators get *staging slots*: owner ``r`` has one slot per source rank, and only that
source ever writes its slot, so concurrent pushes never touch the same bytes and need no locks or atomics. The fence
adds the slots into the accumulator in source-rank order, which makes results bit-reproducible.

Files are unlinked as soon as every rank has mapped them (the mappings stay valid), so nothing is left in
``/dev/shm`` after the job, even if a rank is killed; the short window during allocation is covered by an
``atexit`` hook and by the survivors removing every file of the job when an allocation fails.
"""

from __future__ import annotations

import atexit
import glob
import mmap
import os
import socket
import tempfile
import uuid
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist

from ds_odc.ops.lockstep import HostLockstep
from ds_odc.ops.meeting import Meeting
from ds_odc.ops.transport import GatherPlan, OdcError, ScatterPlan, Segment, SymmetricBuffer, Transport, out_layout

__all__: list[str] = []


def shm_dir() -> str:
    """Where the buffers' files live: /dev/shm (memory) when writable, else the temporary folder."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def _map_files(paths: Sequence[str], numel: int, dtype: torch.dtype) -> tuple[list[torch.Tensor], list[mmap.mmap]]:
    """Every rank's file of one buffer as a tensor over a shared mapping (and the mappings)."""
    nbytes = max(numel, 1) * torch.empty((), dtype=dtype).element_size()
    views, maps = [], []
    for path in paths:
        fd = os.open(path, os.O_RDWR)
        try:
            mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        views.append(torch.frombuffer(mm, dtype=dtype, count=max(numel, 1))[:numel])
        maps.append(mm)
    return views, maps


@dataclass(eq=False)
class ShmBuffer(SymmetricBuffer):
    peers: list[torch.Tensor] = field(default_factory=list)  # rank r's copy, mapped here
    slots: list[torch.Tensor] | None = None  # accumulators: rank r's (world, numel) staging, slot s written by source s
    own: list[mmap.mmap] = field(default_factory=list)  # this rank's files' mappings (evict gives their pages back)


@dataclass(eq=False)
class ShmGatherPlan(GatherPlan):
    copies: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (output offset, peer view) per read


@dataclass(eq=False)
class ShmScatterPlan(ScatterPlan):
    adds: list[tuple[int, int, int, torch.Tensor]] = field(default_factory=list)  # (input, start, n, slot view)


class ShmTransport(Transport):
    name = "shm"
    can_evict = True

    def __init__(self, process_group=None, timeout_s: float = 300.0, control=None, lockstep: bool = False):
        """``control``: a gloo group over the ranks of ``process_group`` for meetings (default: made from it).
        ``lockstep``: take part in lock-step meetings (``odc.lockstep``; :mod:`ds_odc.ops.lockstep`)."""
        self.meet = Meeting(process_group, timeout_s, control)
        super().__init__(self.meet.rank, self.meet.world_size, timeout_s)
        self.lockstep = HostLockstep(self.meet) if lockstep else None
        self.lockstep_tally = self.lockstep.tally if lockstep else None
        group = self.meet.group
        hosts = [None] * self.world_size
        dist.all_gather_object(hosts, socket.gethostname(), group=group)
        if len(set(hosts)) > 1:
            raise OdcError(f"ds_odc: the shm transport shares memory between the ranks of one host, but this group of "
                           f"ranks {self.meet.job_ranks} runs on {sorted(set(hosts))}. Set zero_optimization.odc."
                           "shard_size to \"node\" (one shard group per host), or use the nvshmem transport.")
        tag = [f"ds_odc-{os.getpid()}-{uuid.uuid4().hex[:12]}"] if self.rank == 0 else [None]
        dist.broadcast_object_list(tag, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        self.tag = tag[0]
        self.dir = shm_dir()
        self._count = 0
        self._pending_unlink: set[str] = set()
        atexit.register(self._unlink_pending)

    # -- allocation -------------------------------------------------------------------------------------------
    def _create(self, name: str, nbytes: int) -> list[str]:
        paths = [os.path.join(self.dir, f"{self.tag}-{name}-r{r}") for r in range(self.world_size)]
        fd = os.open(paths[self.rank], os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, max(nbytes, 1))
        finally:
            os.close(fd)
        self._pending_unlink.add(paths[self.rank])
        return paths

    def allocate(self, numel: int, dtype: torch.dtype, *, accumulator: bool = False) -> ShmBuffer:
        itemsize = torch.empty((), dtype=dtype).element_size()
        name = f"b{self._count}"
        self._count += 1
        try:
            paths = self._create(name, numel * itemsize)
            staging_paths = self._create(name + "s", self.world_size * numel * itemsize) if accumulator else None
            self.meet("symmetric allocation (files created)")
            peers, maps = _map_files(paths, numel, dtype)
            own = [maps[self.rank]]
            slots = None
            if accumulator:
                staged, staging_maps = _map_files(staging_paths, self.world_size * numel, dtype)
                slots = [v.view(self.world_size, numel) for v in staged]
                own = [staging_maps[self.rank]]  # an accumulator's own copy is private (below)
            self.meet("symmetric allocation (files mapped)")
        except BaseException:
            self._remove_job_files()
            raise
        self._unlink_pending()
        # An accumulator's own copy is private: peers write only into the staging slots.
        local = torch.zeros(numel, dtype=dtype) if accumulator else peers[self.rank]
        return ShmBuffer(numel, dtype, local, accumulator, peers=peers, slots=slots, own=own)

    def evict(self, buffers: Sequence[ShmBuffer]) -> None:
        """Punch the pages of this rank's files out of ``/dev/shm`` (``MADV_REMOVE``); they read as zeros until
        written again. An accumulator's private copy is zeroed."""
        for buf in buffers:
            for mm in buf.own:
                try:
                    mm.madvise(mmap.MADV_REMOVE)
                except (AttributeError, OSError):  # not Linux, or a file system without hole punching: zero it
                    mm[:] = bytes(len(mm))
            if buf.accumulator:
                buf.local.zero_()

    def _unlink_pending(self) -> None:
        for path in list(self._pending_unlink):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            self._pending_unlink.discard(path)

    def _remove_job_files(self) -> None:
        self._unlink_pending()
        for path in glob.glob(os.path.join(self.dir, f"{self.tag}-*")):
            try:
                os.unlink(path)
            except OSError:
                pass

    # -- data path ----------------------------------------------------------------------------------------------
    def plan_gather(self, source: ShmBuffer, segments: Sequence[Segment]) -> ShmGatherPlan:
        segments = tuple(segments)
        offsets, total = out_layout(segments, self.world_size)
        copies = [(off + r * seg.length, peer.narrow(0, seg.offset, seg.length))
                  for seg, off in zip(segments, offsets) for r, peer in enumerate(source.peers)]
        return ShmGatherPlan(source, segments, offsets, total, copies=copies)

    def gather(self, plan: ShmGatherPlan, out: torch.Tensor) -> None:
        for offset, peer in plan.copies:
            out.narrow(0, offset, peer.numel()).copy_(peer)

    def plan_scatter(self, accumulator: ShmBuffer, segments: Sequence[Segment],
                     input_numels: Sequence[int]) -> ShmScatterPlan:
        segments, numels = tuple(segments), tuple(int(n) for n in input_numels)
        adds = []
        for i, (seg, numel) in enumerate(zip(segments, numels)):
            for r in range(self.world_size):
                n = min(seg.length, numel - r * seg.length)
                if n <= 0:
                    break
                adds.append((i, r * seg.length, n, accumulator.slots[r][self.rank].narrow(0, seg.offset, n)))
        return ShmScatterPlan(accumulator, segments, numels, adds=adds)

    def scatter_accumulate(self, plan: ShmScatterPlan, inputs: Sequence[torch.Tensor], scale: float = 1.0) -> None:
        dtype = plan.accumulator.dtype
        for i, start, n, slot in plan.adds:
            slot.add_(inputs[i].narrow(0, start, n).to(dtype), alpha=scale)

    def fence(self, accumulators: Sequence[ShmBuffer], what: str = "the fence at the optimizer step",
              note: str | None = None) -> dict[int, str | None] | None:
        notes = self.meet(what, note=note) if self.lockstep is None else self.lockstep.meeting(what, note)
        for acc in accumulators:
            slots = acc.slots[self.rank]
            for source in range(self.world_size):  # fixed order: bit-reproducible sums
                acc.local.add_(slots[source])
            slots.zero_()
        return notes

    def barrier(self, what: str = "the barrier after the optimizer step") -> None:
        if self.lockstep is None:
            self.meet(what)
        else:
            self.lockstep.meeting(what)

    def lockstep_barrier(self, what: str) -> None:
        if self.lockstep is None:
            super().lockstep_barrier(what)
        elif self.world_size > 1:
            self.lockstep(what)

    def leave(self, why: str) -> None:
        self.meet.leave(why)

    def close(self) -> None:
        self._unlink_pending()
