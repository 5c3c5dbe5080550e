"""Start and end a distributed training script, on CPU or GPU, under any launcher.

``init_distributed()`` at the top of a script started by ``torchrun``, ``deepspeed`` or ``mpirun``, and
``shutdown_and_exit()`` (or ``shutdown()``, when ``atexit`` handlers such as a logger's must still run) as its last
line::

    from ds_odc.training.distributed import init_distributed, shutdown_and_exit

    init_distributed()
    ...  # deepspeed.initialize, training
    shutdown_and_exit()
"""

from __future__ import annotations

import faulthandler
import os
import sys
import warnings
from datetime import timedelta

__all__ = ["init_distributed", "shutdown", "shutdown_and_exit", "runs_on_cpu"]

DEFAULT_CPU_TIMEOUT_S = 300.0
TORCH_DEPRECATIONS_CALLED_BY_DEEPSPEED = ("all_gather_into_tensor", "reduce_scatter_tensor")


def runs_on_cpu() -> bool:
    """True when the ranks train on CPU: ``DS_ACCELERATOR=cpu`` is set, or there is no CUDA device."""
    import torch
    return os.environ.get("DS_ACCELERATOR") == "cpu" or not torch.cuda.is_available()


def init_distributed(timeout_s: float | None = None) -> None:
    """Initialise ``torch.distributed`` through DeepSpeed: gloo on CPU, DeepSpeed's choice (NCCL) on CUDA.

    ``timeout_s``: how long a collective may wait for the other ranks before it raises, which turns a rank that
    never arrives into an error instead of a hang. When None: 300 s on CPU, DeepSpeed's default (30 minutes) on
    CUDA, where a first step that compiles kernels or a large checkpoint save may legitimately take minutes.

    On CPU this skips DeepSpeed's build of its shared-memory communication op, a 40-65 s g++ compile on first use
    that only ``inference_all_reduce`` needs (never ZeRO training). On CUDA each rank selects the GPU named by
    ``LOCAL_RANK`` first. Under ``mpirun`` a ``MASTER_PORT`` in the environment is honoured (DeepSpeed alone uses
    29500 for every job). Recent torch warns on every rank that ``all_gather_into_tensor`` and
    ``reduce_scatter_tensor`` are deprecated; DeepSpeed makes those calls, not your script, so exactly these two
    warnings are hidden.
    """
    for name in TORCH_DEPRECATIONS_CALLED_BY_DEEPSPEED:
        warnings.filterwarnings("ignore", message=rf"`torch\.distributed\.{name}` is deprecated",
                                category=FutureWarning)
    import deepspeed
    import torch

    on_cpu = runs_on_cpu()
    if timeout_s is None and on_cpu:
        timeout_s = DEFAULT_CPU_TIMEOUT_S
    kwargs = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    if "MASTER_PORT" in os.environ:
        # Under mpirun DeepSpeed's MPI discovery overwrites MASTER_PORT with this argument (29500 by default), so
        # two jobs on one host would collide; a port the launcher chose wins. Other launchers: unused.
        kwargs["distributed_port"] = int(os.environ["MASTER_PORT"])
    if on_cpu:
        from ds_odc.zero import skip_cpu_shm_op_build
        skip_cpu_shm_op_build()
        deepspeed.init_distributed(dist_backend="gloo", **kwargs)
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        deepspeed.init_distributed(**kwargs)


def shutdown() -> None:
    """Wait for every rank, then destroy the process group."""
    import torch.distributed as dist
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def shutdown_and_exit(exit_code: int = 0) -> None:
    """:func:`shutdown`, then exit the process with ``exit_code`` at once, skipping ``atexit`` handlers.

    The exit skips C++ static destructors on purpose: after a successful run, gloo's threads sometimes abort the
    interpreter at exit ("terminate called without an active exception", SIGABRT; about 1 run in 10 on CPU),
    which would make a finished job look failed. Output is flushed and the group is gone by then. Under ``mpirun``
    MPI is finalized first: that is what removes MPICH's ``/dev/shm/mpich_shm_*`` segment, and the hard exit skips
    the ``atexit`` hook in which mpi4py would otherwise do it.
    """
    shutdown()
    _finalize_mpi()
    faulthandler.cancel_dump_traceback_later()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


def _finalize_mpi() -> None:
    """Finalize MPI if this process initialized it (DeepSpeed's MPI discovery imports mpi4py under ``mpirun``)."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
