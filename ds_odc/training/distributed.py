"""Start and end a distributed training script, on CPU or GPU, under any launcher.

``init_distributed()`` at the top of a script started by ``torchrun``, ``deepspeed`` or ``mpirun``, and
``shutdown_and_exit()`` (or ``shutdown()``, when ``atexit`` handlers such as a logger's must still run) as its last
line::

    from ds_odc.training.distributed import init_distributed, shutdown_and_exit

    init_distributed()
    ...  # deepspeed.initialize, training
    shutdown_and_exit()

**Several ranks on one GPU** (``init_distributed(shared_gpu=True)``, or ``DS_ODC_SHARED_GPU=1`` in the environment,
which is how a launcher passes it to every rank): every rank trains on the same GPU, ``torch.distributed`` runs over
gloo (NCCL refuses two ranks on one device) and ODC's NVSHMEM transport makes each process its own PE. For trying a
config or testing multi-rank code on a one-GPU machine; the ranks share the GPU's SMs and gloo stages collectives
through host memory, so it says nothing about speed. In this mode ``LOCAL_RANK`` reads ``0`` on every rank: it is the
GPU index that DeepSpeed, Accelerate and most scripts derive the device from.
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import sys
import warnings
from datetime import timedelta

__all__ = ["init_distributed", "output_folder", "runs_on_cpu", "shutdown", "shutdown_and_exit"]

DEFAULT_CPU_TIMEOUT_S = 300.0
_TEMPORARY_FOLDERS: list[str] = []  # made by output_folder on this rank, removed at exit
TORCH_DEPRECATIONS_CALLED_BY_DEEPSPEED = ("all_gather_into_tensor", "reduce_scatter_tensor")
# transformers 5 deprecated ``PreTrainedModel.is_gradient_checkpointing``; TRL reads it around generation and
# log-probabilities, so the warning names a call that no script makes.
TRANSFORMERS_DEPRECATIONS_CALLED_BY_TRL = (r"`is_gradient_checkpointing` is deprecated",)
SHARED_GPU_ENV = "DS_ODC_SHARED_GPU"
"""``1``: every rank of the job shares one GPU (see the module docstring). Set by ``init_distributed(shared_gpu=True)``
for the rest of the process; a launcher can set it for every rank instead."""
_LAUNCHER_LOCAL_RANK_ENV = "DS_ODC_LAUNCHER_LOCAL_RANK"  # the launcher's LOCAL_RANK, kept when shared mode sets 0
_MPI_LAUNCH_ENV = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE")


def runs_on_cpu() -> bool:
    """True when the ranks train on CPU: ``DS_ACCELERATOR=cpu`` is set, or there is no CUDA device."""
    import torch
    return os.environ.get("DS_ACCELERATOR") == "cpu" or not torch.cuda.is_available()


def shared_gpu_mode() -> bool:
    """True when the ranks of this job share one GPU (``DS_ODC_SHARED_GPU=1``, or ``partition``: each rank on its
    share of the SMs, :mod:`ds_odc.training.partition`)."""
    return os.environ.get(SHARED_GPU_ENV, "").strip().lower() in ("1", "true", "yes", "on", "partition")


def partitioned_gpu_mode() -> bool:
    """True when the ranks of this job run on SM partitions of one GPU (``DS_ODC_SHARED_GPU=partition``)."""
    return os.environ.get(SHARED_GPU_ENV, "").strip().lower() == "partition"


def training_device():
    """The device this rank trains on: the CPU, the one shared GPU (``cuda:0``), or the GPU named by ``LOCAL_RANK``."""
    import torch
    if runs_on_cpu():
        return torch.device("cpu")
    return torch.device("cuda", 0 if shared_gpu_mode() else int(os.environ.get("LOCAL_RANK", 0)))


def _share_one_gpu() -> None:
    """Put every rank on GPU 0, or say why that cannot work here."""
    import torch
    if os.environ.get("DS_ACCELERATOR") == "cpu" or not torch.cuda.is_available():
        raise RuntimeError("ds_odc: shared_gpu=True (DS_ODC_SHARED_GPU=1) needs a CUDA GPU, and this process sees none"
                           + (" (DS_ACCELERATOR=cpu)" if os.environ.get("DS_ACCELERATOR") == "cpu" else "") +
                           ". CPU ranks share the host without it: drop the option.")
    if any(k in os.environ for k in _MPI_LAUNCH_ENV):
        raise RuntimeError("ds_odc: shared_gpu=True is not supported under mpirun: DeepSpeed takes each rank's GPU from "
                           "the MPI local rank there. Launch with torchrun or the deepspeed launcher.")
    if partitioned_gpu_mode():
        from ds_odc.training.partition import check_partition_env
        check_partition_env()
    os.environ.setdefault(_LAUNCHER_LOCAL_RANK_ENV, os.environ.get("LOCAL_RANK", "0"))
    os.environ["LOCAL_RANK"] = "0"
    if not partitioned_gpu_mode():
        os.environ[SHARED_GPU_ENV] = "1"  # for the rest of this process (ODC's checks, the report) and its children


def init_distributed(timeout_s: float | None = None, *, shared_gpu: bool | None = None) -> None:
    """Initialise ``torch.distributed`` through DeepSpeed: gloo on CPU, DeepSpeed's choice (NCCL) on CUDA.

    ``timeout_s``: how long a collective may wait for the other ranks before it raises, which turns a rank that
    never arrives into an error instead of a hang. When None: 300 s on CPU and on a shared GPU, DeepSpeed's default
    (30 minutes) on CUDA, where a first step that compiles kernels or a large checkpoint save may legitimately take
    minutes.

    ``shared_gpu``: run every rank on one GPU (see the module docstring); None reads ``DS_ODC_SHARED_GPU``. Raises
    where that cannot work: no CUDA device, or a job started by ``mpirun``.

    On CUDA each rank selects the GPU named by
    ``LOCAL_RANK`` first. Under ``mpirun`` a ``MASTER_PORT`` in the environment is honoured (DeepSpeed alone uses
    29500 for every job). Recent torch warns on every rank that ``all_gather_into_tensor`` and
    ``reduce_scatter_tensor`` are deprecated, and transformers 5 that ``is_gradient_checkpointing`` is; DeepSpeed and
    TRL make those calls, not your script, so exactly these warnings are hidden.
    """
    for name in TORCH_DEPRECATIONS_CALLED_BY_DEEPSPEED:
        warnings.filterwarnings("ignore", message=rf"`torch\.distributed\.{name}` is deprecated",
                                category=FutureWarning)
    for message in TRANSFORMERS_DEPRECATIONS_CALLED_BY_TRL:
        warnings.filterwarnings("ignore", message=message, category=FutureWarning)
    import deepspeed
    import torch

    sharing = shared_gpu_mode() if shared_gpu is None else shared_gpu
    if sharing:
        _share_one_gpu()
    else:
        os.environ.pop(SHARED_GPU_ENV, None)
    on_cpu = runs_on_cpu()
    if timeout_s is None and (on_cpu or sharing):
        timeout_s = DEFAULT_CPU_TIMEOUT_S
    kwargs = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    if "MASTER_PORT" in os.environ:
        # Under mpirun DeepSpeed's MPI discovery overwrites MASTER_PORT with this argument (29500 by default), so
        # two jobs on one host would collide; a port the launcher chose wins. Other launchers: unused.
        kwargs["distributed_port"] = int(os.environ["MASTER_PORT"])
    if on_cpu:
        deepspeed.init_distributed(dist_backend="gloo", **kwargs)
    elif sharing:
        torch.cuda.set_device(0)
        # torch.distributed first, without binding a device (DeepSpeed would pass device_id for NCCL's sake).
        torch.distributed.init_process_group("gloo", timeout=kwargs["timeout"])
        deepspeed.init_distributed(dist_backend="gloo", **kwargs)
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        deepspeed.init_distributed(**kwargs)


def output_folder(path: str | None, prefix: str = "ds_odc_") -> str:
    """Where a script writes its outputs: ``path`` when the user named one, else a new temporary folder that every
    rank of the job names the same (rank 0 makes it and sends its path to the others) and that rank 0 removes when
    its process exits, so that nothing is left in the folder the script was started from. Call it on every rank,
    after :func:`init_distributed`."""
    if path is not None:
        return path
    import atexit
    import tempfile

    import torch.distributed as dist
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    made = [tempfile.mkdtemp(prefix=prefix) if rank0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(made, src=0)
    if rank0:
        atexit.register(shutil.rmtree, made[0], ignore_errors=True)
        _TEMPORARY_FOLDERS.append(made[0])  # shutdown_and_exit skips atexit: it removes them itself
    return made[0]


def shutdown() -> None:
    """Wait for every rank, then destroy the process group. Ranks still meeting at an ODC step are told that this one
    has finished, so that the error they raise says so (a rank that took fewer steps)."""
    import torch.distributed as dist

    from ds_odc.ops.meeting import leave_meetings
    leave_meetings("reached shutdown()")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def shutdown_and_exit(exit_code: int = 0) -> None:
    """:func:`shutdown`, then exit the process with ``exit_code`` at once, skipping ``atexit`` handlers.

    The exit skips C++ static destructors on purpose: after a successful run, gloo's threads sometimes abort the
    interpreter at exit ("terminate called without an active exception", SIGABRT; about 1 run in 10 on CPU),
    which would make a finished job look failed. Output is flushed and the group is gone by then. Under ``mpirun``
    MPI is finalized first: that is what removes MPICH's ``/dev/shm/mpich_shm_*`` segment, and the hard exit skips
    the ``atexit`` hook in which mpi4py would otherwise do it; likewise the CUDA driver's ``/dev/shm/cuda.shm.*`` file
    of a process that used the NVSHMEM transport is removed, and the temporary folders of :func:`output_folder`.
    """
    shutdown()
    _finalize_mpi()
    for folder in _TEMPORARY_FOLDERS:
        shutil.rmtree(folder, ignore_errors=True)
    if "ds_odc.ops.nvshmem_runtime" in sys.modules:  # the hard exit skips the atexit hook that removes its file
        sys.modules["ds_odc.ops.nvshmem_runtime"].remove_cuda_shm_files()
    faulthandler.cancel_dump_traceback_later()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


def _finalize_mpi() -> None:
    """Finalize MPI if this process initialized it (DeepSpeed's MPI discovery imports mpi4py under ``mpirun``)."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
