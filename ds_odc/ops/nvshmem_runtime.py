"""NVSHMEM bring-up for ds_odc: one runtime per process, started over torch.distributed or MPI.

NVSHMEM's host library is already loaded in every process that imports torch (torch links it), so there is exactly
one runtime per process; nvshmem4py and our extension both talk to it. Bring-up:

1. choose the bootstrap (``zero_optimization.odc.bootstrap``): ``auto`` sends NVSHMEM's unique id over mpi4py under
   ``mpirun`` (``OMPI_COMM_WORLD_SIZE`` / ``PMI_SIZE`` set) and over torch.distributed otherwise; ``uid`` and ``mpi``
   force one of the two; ``mpi-native`` uses NVSHMEM's own MPI bootstrap plugin, which must match the MPI library;
2. size the symmetric heap from what is about to be allocated (``NVSHMEM_SYMMETRIC_SIZE``, unless the user set it);
   with CUDA VMM (NVSHMEM's default) the heap grows on later allocations, up to ``NVSHMEM_MAX_MEMORY_PER_GPU``;
3. initialise, then *check* the status: NVSHMEM can return from init without a transport and only die (exit 255) at
   the first allocation;
4. attach our extension's device code to the runtime (see ``odc_attach`` in csrc/odc_kernels.cu).
"""

from __future__ import annotations

import atexit
import glob
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ds_odc.ops.transport import OdcError

__all__ = ["ensure_runtime"]

MiB = 1 << 20
STATUS_IS_INITIALIZED = 2  # nvshmemx_init_status_t
STATUS_INVALID = 2**31 - 1
HEAP_SLACK = 64 * MiB
HEAP_GRANULARITY = 64 * MiB  # NVSHMEM's own internal allocations (team state, signal pads) live in the heap too

_HINT = ("Run with NVSHMEM_DEBUG=INFO to see which transport NVSHMEM tried. On one host NVLink peers need no NIC: "
         "leave NVSHMEM_DISABLE_P2P unset and set NVSHMEM_REMOTE_TRANSPORT=none if no InfiniBand HCA is present; "
         "if the unique-id bootstrap picks the wrong interface, set NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME (e.g. eth0).")


@dataclass
class Runtime:
    lib: object  # the compiled extension (ds_odc.ops.builder.load_op())
    my_pe: int
    n_pes: int
    bootstrap: str  # how it came up: "torch-uid", "mpi-uid", "mpi-native" or "existing"


_RUNTIME: Runtime | None = None


def launched_by_mpirun() -> bool:
    return any(k in os.environ for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE"))


BOOTSTRAPS = {"uid": "torch-uid", "mpi": "mpi-uid", "mpi-native": "mpi-native"}


def bootstrap_method(choice: str = "auto") -> str:
    """How NVSHMEM will come up for the config value ``choice`` (``auto``, ``uid``, ``mpi`` or ``mpi-native``)."""
    if choice == "auto":
        return "mpi-uid" if launched_by_mpirun() else "torch-uid"
    if choice not in BOOTSTRAPS:
        raise OdcError(f"ds_odc: zero_optimization.odc.bootstrap={choice!r}; use auto, uid, mpi or mpi-native")
    return BOOTSTRAPS[choice]


def _set_heap_defaults(heap_bytes: int) -> None:
    """Size the heap from the allocation that triggers bring-up, not from a fixed guess; users' settings win."""
    os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(_round_up(heap_bytes + HEAP_SLACK, 2 * MiB)))
    # The heap grows in steps of this size; NVSHMEM's 512 MiB default strands up to that much. 64 MiB measured
    # 320 MiB less GPU memory for the same buffers on 2x H200 (docs/BENCHMARKS.md).
    os.environ.setdefault("NVSHMEM_CUMEM_GRANULARITY", str(HEAP_GRANULARITY))
    # ds_odc never uses NVLink SHARP (multicast); keep NVSHMEM from setting it up.
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")


def _round_up(value: int, step: int) -> int:
    return (value + step - 1) // step * step


def _import_nvshmem4py():
    try:
        import nvshmem.core as nvshmem
        from cuda.core import Device
    except ImportError as err:
        raise OdcError("ds_odc: the nvshmem transport needs nvshmem4py: pip install --no-deps nvshmem4py-cu13==0.4.1 "
                       f"(and cuda-core). Import failed: {err}") from err
    return nvshmem, Device


def _init_over_torch(nvshmem, device, group) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    uid = nvshmem.get_unique_id() if rank == 0 else nvshmem.get_unique_id(empty=True)
    box = [uid if rank == 0 else None]
    dist.broadcast_object_list(box, src=0, group=group)
    nvshmem.init(device=device, uid=box[0], rank=rank, nranks=world, initializer_method="uid")


def _init_over_mpi(nvshmem, device, native: bool) -> None:
    try:
        from mpi4py import MPI
    except ImportError as err:
        raise OdcError("ds_odc: launched by mpirun, so NVSHMEM bring-up uses mpi4py, which is not installed "
                       "(pip install mpi4py), or set zero_optimization.odc.bootstrap to \"uid\" to bootstrap over "
                       "torch.distributed instead.") from err
    comm = MPI.COMM_WORLD
    if dist.is_initialized() and (comm.Get_rank(), comm.Get_size()) != (dist.get_rank(), dist.get_world_size()):
        raise OdcError(f"ds_odc: MPI rank {comm.Get_rank()}/{comm.Get_size()} differs from torch.distributed rank "
                       f"{dist.get_rank()}/{dist.get_world_size()}; NVSHMEM PEs must be the global ranks. "
                       "Set zero_optimization.odc.bootstrap to \"uid\" to bootstrap over torch.distributed.")
    if native:
        nvshmem.init(device=device, mpi_comm=comm, initializer_method="mpi")
        return
    uid = nvshmem.get_unique_id() if comm.Get_rank() == 0 else None
    uid = comm.bcast(uid, root=0)
    nvshmem.init(device=device, uid=uid, rank=comm.Get_rank(), nranks=comm.Get_size(), initializer_method="uid")


def ensure_runtime(control_group, heap_bytes: int, bootstrap: str = "auto") -> Runtime:
    """Bring NVSHMEM up once per process (collective on first call) and attach our kernels to it."""
    global _RUNTIME
    if _RUNTIME is not None:
        return _RUNTIME
    from ds_odc.ops.builder import load_op
    lib = load_op()
    how = "existing"
    if lib.init_status() < STATUS_IS_INITIALIZED:  # nobody (torch symmetric memory, the user) brought it up yet
        nvshmem, Device = _import_nvshmem4py()
        _set_heap_defaults(heap_bytes)
        device = Device(torch.cuda.current_device())
        device.set_current()
        how = bootstrap_method(bootstrap)
        try:
            if how == "torch-uid":
                _init_over_torch(nvshmem, device, control_group)
            else:
                _init_over_mpi(nvshmem, device, native=how == "mpi-native")
        except OdcError:
            raise
        except Exception as err:  # nvshmem4py raises its own types; name the knobs instead
            raise OdcError(f"ds_odc: NVSHMEM bring-up ({how}) failed: {err}. {_HINT}") from err
    status = lib.init_status()
    if not STATUS_IS_INITIALIZED <= status < STATUS_INVALID:
        raise OdcError(f"ds_odc: NVSHMEM init returned but its status is {status}, not initialised: no transport "
                       f"could start. {_HINT}")
    try:
        lib.attach()
    except RuntimeError as err:
        raise OdcError(f"ds_odc: could not attach the ds_odc kernels to the NVSHMEM runtime: {err}. {_HINT}") from err
    my_pe, n_pes = lib.my_pe(), lib.n_pes()
    if dist.is_initialized() and (my_pe, n_pes) != (dist.get_rank(), dist.get_world_size()):
        raise OdcError(f"ds_odc: NVSHMEM PE {my_pe}/{n_pes} is not torch.distributed rank "
                       f"{dist.get_rank()}/{dist.get_world_size()}; launch one process per GPU with the same ranks.")
    _RUNTIME = Runtime(lib, my_pe, n_pes, how)
    atexit.register(remove_cuda_shm_files)
    return _RUNTIME


def remove_cuda_shm_files() -> None:
    """Remove this process's ``/dev/shm/cuda.shm.<device>.<pid in hex>.<n>``: the CUDA driver creates one for every
    process whose GPU memory peers map (NVSHMEM's peer access), and leaves it behind when the process exits (seen on
    H200 hosts with CUDA 13), so each training process would leave one file per run."""
    for path in glob.glob(f"/dev/shm/cuda.shm.*.{os.getpid():x}.*"):
        try:
            os.unlink(path)
        except OSError:
            pass
