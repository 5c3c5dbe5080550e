"""NVSHMEM transport: ODC's one-sided gather and scatter-accumulate between GPUs.

Every symmetric buffer is one ``nvshmem_malloc`` allocation, so a peer's copy of ``offset`` is reachable either as
a plain pointer (NVLink peers: ``nvshmem_ptr``) or through NVSHMEM's RMA calls (any peer, including other nodes).
Two paths, chosen once per transport:

* **peer-pointer path** (default when every peer is load/store reachable): gather = copy-engine reads straight from
  the owners' memory (``cudaMemcpyAsync`` over NVLink); scatter-accumulate = fp32 vector reductions
  (``red.add.v4.f32``) into the owners' accumulators from one kernel per call. No staging memory; the order in which
  sources' contributions are summed is not fixed (fp32 rounding may differ run to run). ``scatter_method="staging"``
  trades (W-1) x accumulator memory for bit-reproducible sums (single-writer slots, summed in source order).
* **RMA path** (``force_remote_path=True``, or automatically when some peer is not P2P-reachable): gather =
  ``nvshmemx_getmem_on_stream``; scatter-accumulate = a kernel that, for each chunk, gets this source's private
  staging slot on the owner, adds the gradient, and puts it back. Slots have a single writer, so no float atomics
  cross the network (NVSHMEM 3.4 has none); the owner adds the slots into its accumulator at the fence, in source
  order. Costs (W-1) x the accumulator in staging memory.

The fence: finish this rank's pushes (``quiet`` + device sync), meet everyone on a gloo ``monitored_barrier`` (which
names ranks that do not arrive), then drain staging slots where there are any.
"""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist

from ds_odc.ops.nvshmem_runtime import ensure_runtime
from ds_odc.ops.shm import control_group, monitored_barrier
from ds_odc.ops.transport import OdcError, Segment, SymmetricBuffer, Transport

_SRC_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_P2P_MODES = {"atomic-scalar": 0, "atomic": 1, "staging": 2}  # odc_scatter_add_p2p's modes
_RMA_CTAS = 264  # device-initiated transfers need many CTAs in flight (2 per SM on H100/H200)
_MIN_ALLOC = 512  # nvshmem_malloc(0) returns NULL; keep every buffer addressable


class _Allocation:
    """One symmetric allocation and this rank's view of every peer's copy."""

    def __init__(self, transport: "NvshmemTransport", nbytes: int):
        self.ptr = transport._malloc(nbytes)
        self.nbytes = nbytes
        # 0 where the peer is not load/store reachable; the peer-pointer path is only taken when none is 0
        self.peer = [transport.lib.peer_ptr(self.ptr, pe) if pe != transport.my_pe else self.ptr
                     for pe in transport.pes]


class _Buffer:
    """What ``SymmetricBuffer.handle`` holds for this transport."""

    def __init__(self, data: _Allocation, staging: _Allocation | None, staging_view: torch.Tensor | None):
        self.data = data
        self.staging = staging
        self.staging_view = staging_view  # (W-1, numel) float32: slot s holds source slot_source[s]'s pushes


def _segment_arrays(segments: Sequence[Segment]) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.fromiter((s.length for s in segments), np.int64, len(segments))
    offsets = np.fromiter((s.offset for s in segments), np.int64, len(segments))
    return lengths, offsets


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
                 scatter_method: str | None = None):
        """``scatter_method`` (peer-pointer path only): "atomic" (default: vector fp32 reductions), "atomic-scalar",
        or "staging" (deterministic: read-modify-write of per-source slots through peer views). Also settable with
        ``DS_ODC_SCATTER_METHOD``; the RMA path always stages."""
        group = control_group(process_group)
        super().__init__(dist.get_rank(group), dist.get_world_size(group), timeout_s)
        if self.world_size != dist.get_world_size():
            raise OdcError("ds_odc: the nvshmem transport spans the whole job (NVSHMEM allocations are collective over "
                           f"every process), but the process group has {self.world_size} of {dist.get_world_size()} "
                           "ranks. Use the world group for ODC.")
        if not torch.cuda.is_available():
            raise OdcError("ds_odc: the nvshmem transport needs CUDA; set zero_optimization.odc.transport to 'shm'.")
        self.group = group
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.pes = [dist.get_global_rank(group, r) if process_group is not None else r for r in range(self.world_size)]
        self.force_remote_path = force_remote_path
        method = (scatter_method or os.environ.get("DS_ODC_SCATTER_METHOD") or "atomic").lower()
        if method not in ("atomic", "atomic-scalar", "staging"):
            raise OdcError(f"ds_odc: scatter method {method!r}; use atomic, atomic-scalar or staging")
        self.scatter_method = method
        self.lib = None
        self.my_pe = None
        self.remote = force_remote_path  # decided for good at the first allocation
        self._allocations: list[_Allocation] = []
        self._buffers: list[SymmetricBuffer] = []
        self._scratch: _Allocation | None = None
        self._scratch_done: torch.cuda.Event | None = None
        self._broken = False
        self.symmetric_bytes = 0  # everything this transport holds in the symmetric heap

    # -- bring-up and allocation --------------------------------------------------------------------------------------
    def _start(self, first_bytes: int) -> None:
        runtime = ensure_runtime(self.group, first_bytes)
        self.lib, self.my_pe = runtime.lib, runtime.my_pe
        if not self.remote:
            # Probe reachability once; every rank must take the same path, so agree on it.
            probe = _Allocation(self, _MIN_ALLOC)
            self._allocations.append(probe)
            reachable = torch.tensor([int(all(probe.peer))], dtype=torch.int32)
            dist.all_reduce(reachable, op=dist.ReduceOp.MIN, group=self.group)
            self.remote = not bool(reachable.item())
        self._rma_chunk = self.lib.rma_chunk_elems()

    def _malloc(self, nbytes: int) -> int:
        # Agree that everyone can afford it before the collective malloc: a rank failing alone would hang the others.
        free, _ = torch.cuda.mem_get_info(self.device)
        ok = torch.tensor([int(nbytes <= free)], dtype=torch.int32)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.group)
        ptr = self.lib.malloc(nbytes) if ok.item() else 0
        if not ptr:
            raise OdcError(
                f"ds_odc: rank {self.rank}: NVSHMEM could not allocate {nbytes / 2**20:.1f} MiB of symmetric memory "
                f"({self.symmetric_bytes / 2**20:.1f} MiB held by ds_odc, {free / 2**20:.1f} MiB free on the GPU here). "
                "The heap grows on demand up to NVSHMEM_MAX_MEMORY_PER_GPU (default 128 GiB); raise it, or set "
                "NVSHMEM_SYMMETRIC_SIZE to the total if NVSHMEM_DISABLE_CUDA_VMM=1 (fixed heap), or free GPU memory.")
        self.symmetric_bytes += nbytes
        return ptr

    def allocate(self, numel: int, dtype: torch.dtype, *, accumulator: bool = False) -> SymmetricBuffer:
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
        buf = SymmetricBuffer(numel, dtype, local, accumulator, handle=_Buffer(data, staging, staging_view))
        self._buffers.append(buf)
        # Zeros must land everywhere before any peer reads or pushes.
        torch.cuda.synchronize(self.device)
        monitored_barrier(self.group, self.timeout_s, "symmetric allocation")
        return buf

    def _stages(self) -> bool:
        return self.remote or self.scatter_method == "staging"

    def _slot(self, source: int, owner: int) -> int:
        """Index of ``source``'s staging slot on ``owner`` (owners keep no slot for themselves)."""
        return source if source < owner else source - 1

    # -- gather ---------------------------------------------------------------------------------------------------------
    def gather(self, source: SymmetricBuffer, segments: Sequence[Segment], outputs: Sequence[torch.Tensor]) -> None:
        if not segments:
            return
        data: _Allocation = source.handle.data
        itemsize = source.local.element_size()
        for seg, out in zip(segments, outputs):
            if out.dtype != source.dtype or not out.is_contiguous() or out.numel() < self.world_size * seg.length:
                raise OdcError(f"ds_odc: gather output must be contiguous {source.dtype} of "
                               f"{self.world_size * seg.length} elements, got {out.dtype} {tuple(out.shape)}")
        lengths, offsets = _segment_arrays(segments)
        out_ptrs = np.fromiter((o.data_ptr() for o in outputs), np.int64, len(outputs))
        dst, src, nbytes, pes = [], [], [], []
        for r in self._owner_order():  # W ranks gathering at once spread their reads over all owners
            base = data.ptr if self.remote else data.peer[r]
            dst.append(out_ptrs + r * lengths * itemsize)
            src.append(base + offsets * itemsize)
            nbytes.append(lengths * itemsize)
            pes.append(np.full(len(segments), self.pes[r], np.int64))
        dst, src, nbytes, pes = (np.ascontiguousarray(np.concatenate(a)) for a in (dst, src, nbytes, pes))
        stream = torch.cuda.current_stream(self.device).cuda_stream
        if self.remote:
            self.lib.get_batch(dst.ctypes.data, src.ctypes.data, nbytes.ctypes.data, pes.ctypes.data, len(dst), stream)
        else:
            self.lib.copy_batch(dst.ctypes.data, src.ctypes.data, nbytes.ctypes.data, len(dst), stream)

    def _owner_order(self) -> list[int]:
        """Owners starting with the next rank, so that concurrent callers do not all hit rank 0 first."""
        return [(self.rank + k) % self.world_size for k in range(1, self.world_size + 1)]

    # -- scatter-accumulate ---------------------------------------------------------------------------------------------
    def scatter_accumulate(self, accumulator: SymmetricBuffer, segments: Sequence[Segment],
                           inputs: Sequence[torch.Tensor], scale: float = 1.0) -> None:
        if not segments:
            return
        dtype = inputs[0].dtype
        if dtype not in _SRC_DTYPES or any(inp.dtype != dtype or not inp.is_contiguous() for inp in inputs):
            raise OdcError(f"ds_odc: scatter_accumulate inputs must be contiguous and share one of "
                           f"{list(_SRC_DTYPES)}, got {sorted({str(i.dtype) for i in inputs})}")
        handle: _Buffer = accumulator.handle
        staging = handle.staging
        if self.remote:
            targets = self._rma_targets(accumulator)
        else:
            if staging is None and self.scatter_method == "staging":
                raise OdcError("ds_odc: this accumulator was allocated without staging slots; choose scatter_method "
                               "'staging' before allocating it")
            targets = self._p2p_targets(accumulator)
        tasks = self._tasks(segments, inputs, targets)
        if len(tasks) == 0:
            return
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

    def _p2p_targets(self, acc: SymmetricBuffer) -> list[int]:
        """Per owner rank, the address (through peer pointers) that element 0 of this rank's pushes lands on."""
        data, staging = acc.handle.data, acc.handle.staging
        if staging is None:  # reductions straight into every owner's accumulator
            return list(data.peer)
        # single-writer slots on the others; our own slice goes straight into acc.local, which only we write
        slot_bytes = acc.numel * 4
        return [data.ptr if r == self.rank else staging.peer[r] + self._slot(self.rank, r) * slot_bytes
                for r in range(self.world_size)]

    def _rma_targets(self, acc: SymmetricBuffer) -> list[int]:
        """Per owner rank, the symmetric address of our slot there (our own slice: the accumulator itself)."""
        data, staging = acc.handle.data, acc.handle.staging
        slot_bytes = acc.numel * 4
        return [data.ptr if r == self.rank else staging.ptr + self._slot(self.rank, r) * slot_bytes
                for r in range(self.world_size)]

    def _tasks(self, segments, inputs, targets) -> np.ndarray:
        """[tasks, 6] int64 rows (dst, src, n, -, pe, -) for every (segment, owner) slice that exists.

        ``inputs[i]`` may stop short of ``W * length``: the missing tail is padding owned by the last ranks."""
        lengths, offsets = _segment_arrays(segments)
        src_ptrs = np.fromiter((t.data_ptr() for t in inputs), np.int64, len(inputs))
        numels = np.fromiter((t.numel() for t in inputs), np.int64, len(inputs))
        esize = inputs[0].element_size()
        blocks = []
        for r in self._owner_order():
            n = np.minimum(lengths, numels - r * lengths)
            keep = n > 0
            rows = np.zeros((int(keep.sum()), 6), np.int64)
            rows[:, 0] = targets[r] + offsets[keep] * 4
            rows[:, 1] = src_ptrs[keep] + r * lengths[keep] * esize
            rows[:, 2] = n[keep]
            rows[:, 4] = self.pes[r]
            blocks.append(rows)
        return np.ascontiguousarray(np.concatenate(blocks))

    # -- synchronisation ------------------------------------------------------------------------------------------------
    def _complete_local_work(self) -> None:
        if self.lib is not None and self.remote:
            self.lib.quiet_on_stream(torch.cuda.current_stream(self.device).cuda_stream)
        torch.cuda.synchronize(self.device)  # every stream: pushes issued on the reduce stream are covered too

    def _arrive(self, what: str) -> None:
        try:
            monitored_barrier(self.group, self.timeout_s, what)
        except BaseException:
            self._broken = True  # peers may be gone: never enter another collective NVSHMEM call (it would hang)
            raise

    def fence(self, accumulators: Sequence[SymmetricBuffer]) -> None:
        self._complete_local_work()
        self._arrive("fence at the optimizer step")
        for acc in accumulators:
            slots = acc.handle.staging_view if acc.handle is not None else None
            if slots is None:
                continue
            for s in range(slots.shape[0]):  # fixed source order: bit-reproducible sums
                acc.local.add_(slots[s])
            slots.zero_()

    def barrier(self) -> None:
        # Zeroed accumulators and updated shards must be in memory before any peer pushes or reads again.
        self._complete_local_work()
        self._arrive("barrier after the optimizer step")

    def close(self) -> None:
        if self.lib is None:
            return
        torch.cuda.synchronize(self.device)
        if not self._broken:
            for alloc in reversed(self._allocations):  # nvshmem_free is collective: same order everywhere
                self.lib.free(alloc.ptr)
        self._allocations.clear()
        self._buffers.clear()
        self._scratch = None
        self.symmetric_bytes = 0
        self.lib = None
