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
import re
import tempfile
import uuid
from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist

from ds_odc.ops.transport import FenceTimeout, Segment, SymmetricBuffer, Transport


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def control_group(process_group=None):
    """A gloo group over the same ranks as ``process_group``: fences must time out and name ranks (gloo's
    ``monitored_barrier``), whatever backend carries the training collectives."""
    if dist.get_backend(process_group) == "gloo":
        return process_group
    ranks = dist.get_process_group_ranks(process_group) if process_group is not None else None
    return dist.new_group(ranks=ranks, backend="gloo")


def monitored_barrier(group, timeout_s: float, what: str) -> None:
    """A barrier that raises :class:`FenceTimeout` naming the ranks that did not arrive, instead of hanging."""
    try:
        dist.monitored_barrier(group=group, timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
    except RuntimeError as err:
        text = str(err)
        missing = []
        found = re.search(r"[Rr]anks? ([\d, ]+) failed", text)
        if found:
            missing = [int(r) for r in re.findall(r"\d+", found.group(1))]
        who = f"ranks {missing} did not arrive" if missing else "a peer did not arrive or died"
        raise FenceTimeout(
            f"ds_odc: rank {dist.get_rank()}: {what} did not complete within {timeout_s:g} s: {who}. "
            f"Look at the logs of those ranks; if their minibatch is legitimately longer, raise "
            f"zero_optimization.odc.timeout_s. (backend said: {text.strip()[:300]})",
            missing,
        ) from err


class _Mapping:
    """All ranks' copies of one file-backed buffer, as tensors."""

    def __init__(self, paths: Sequence[str], numel: int, dtype: torch.dtype):
        nbytes = max(numel, 1) * torch.empty((), dtype=dtype).element_size()
        self.maps = []
        self.views = []
        for path in paths:
            fd = os.open(path, os.O_RDWR)
            try:
                mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
            self.maps.append(mm)
            self.views.append(torch.frombuffer(mm, dtype=dtype, count=max(numel, 1))[:numel])


class ShmTransport(Transport):
    name = "shm"

    def __init__(self, process_group=None, timeout_s: float = 300.0):
        group = control_group(process_group)
        super().__init__(dist.get_rank(group), dist.get_world_size(group), timeout_s)
        self.group = group
        tag = [f"ds_odc-{os.getpid()}-{uuid.uuid4().hex[:12]}"] if self.rank == 0 else [None]
        dist.broadcast_object_list(tag, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        self.tag = tag[0]
        self.dir = _shm_dir()
        self._count = 0
        self._pending_unlink: set[str] = set()
        self._buffers: list[SymmetricBuffer] = []
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

    def allocate(self, numel: int, dtype: torch.dtype, *, accumulator: bool = False) -> SymmetricBuffer:
        itemsize = torch.empty((), dtype=dtype).element_size()
        name = f"b{self._count}"
        self._count += 1
        try:
            paths = self._create(name, numel * itemsize)
            staging_paths = self._create(name + "s", self.world_size * numel * itemsize) if accumulator else None
            monitored_barrier(self.group, self.timeout_s, "symmetric allocation (files created)")
            mapping = _Mapping(paths, numel, dtype)
            staging = _Mapping(staging_paths, self.world_size * numel, dtype) if accumulator else None
            monitored_barrier(self.group, self.timeout_s, "symmetric allocation (files mapped)")
        except BaseException:
            self._remove_job_files()
            raise
        self._unlink_pending()
        local = torch.zeros(numel, dtype=dtype) if accumulator else mapping.views[self.rank]
        buf = SymmetricBuffer(numel, dtype, local, accumulator, handle=(mapping, staging))
        self._buffers.append(buf)
        return buf

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
    def gather(self, source: SymmetricBuffer, segments: Sequence[Segment], outputs: Sequence[torch.Tensor]) -> None:
        peers = source.handle[0].views
        for seg, out in zip(segments, outputs):
            for r, peer in enumerate(peers):
                out.narrow(0, r * seg.length, seg.length).copy_(peer.narrow(0, seg.offset, seg.length))

    def scatter_accumulate(self, accumulator: SymmetricBuffer, segments: Sequence[Segment],
                           inputs: Sequence[torch.Tensor], scale: float = 1.0) -> None:
        staging = accumulator.handle[1].views
        my_slot = self.rank * accumulator.numel
        for seg, inp in zip(segments, inputs):
            inp = inp.reshape(-1)
            for r in range(self.world_size):
                start = r * seg.length
                n = min(seg.length, inp.numel() - start)
                if n <= 0:
                    break
                slot = staging[r].narrow(0, my_slot + seg.offset, n)
                slot.add_(inp.narrow(0, start, n).to(accumulator.dtype), alpha=scale)

    def fence(self, accumulators: Sequence[SymmetricBuffer]) -> None:
        monitored_barrier(self.group, self.timeout_s, "fence at the optimizer step")
        for acc in accumulators:
            slots = acc.handle[1].views[self.rank].view(self.world_size, acc.numel)
            for source in range(self.world_size):  # fixed order: bit-reproducible sums
                acc.local.add_(slots[source])
            slots.zero_()

    def barrier(self) -> None:
        monitored_barrier(self.group, self.timeout_s, "barrier after the optimizer step")

    def close(self) -> None:
        self._unlink_pending()
        self._buffers.clear()
