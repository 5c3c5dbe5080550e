"""N ranks on N partitions of one GPU's SMs (CUDA MPS), to measure what happens *between* ranks on a one-GPU machine.

Ranks that share one GPU with all its SMs (``DS_ODC_SHARED_GPU=1``) lend each other the GPU whenever one of them
waits, so an imbalance between ranks costs nothing there: fine for checking correctness, useless for speed. Under
CUDA MPS each process can be held to a share of the SMs (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``); a rank held to 1/N
that finishes early leaves its SMs idle, as a separate GPU would. Run a command that way::

    python -m ds_odc.training.partition --nproc 4 -- \\
        torchrun --standalone --nproc_per_node 4 examples/sft.py --deepspeed ds_configs/zero3_odc_bf16.json ...

This starts an MPS control daemon of your own (its pipe and log folders in a temporary folder; nothing about the
GPU's settings changes: not its compute mode, clocks or MIG layout), runs the command with every rank sharing GPU 0
at ``100 // N`` percent of the SMs (``DS_ODC_SHARED_GPU=partition``), and stops the daemon afterwards, also when the
command fails. :func:`gpu_partitions` does the same around launches of your own (the benchmarks' ``--partition-gpu``).

What partitions model and what they do not (docs/GPU.md has the measurements): each rank computes on its own share
of the SMs (a bf16 matrix product at 1/2 and 1/4 of an H100's SMs ran at 0.49 and 0.25 of the whole GPU's rate with
the other partitions busy), and waits for the others as it would on its own GPU. The GPU's power budget, memory
bandwidth, L2 cache and copy engines stay shared: a partition whose neighbours idle runs at a higher clock (0.65 and
0.36 of the whole GPU's rate alone), so a rank that runs while others wait is helped, which shortens exactly the
waits ODC removes. Yet ranks with the same work drift apart on partitions (a lock-step run on equal lengths waited
11% of its time), which lengthens them; how much of either separate GPUs show is not measured. One-sided traffic
between ranks stays on the device instead of crossing NVLink.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

__all__ = ["gpu_partitions"]

PARTITION = "partition"
"""The value of ``DS_ODC_SHARED_GPU`` that says: every rank on GPU 0, each held to its share of the SMs by MPS."""
_MPS_ENV = ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")
_PERCENTAGE = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"


def mps_control() -> str:
    """The MPS control program (``nvidia-cuda-mps-control``), or an error that says where it comes from."""
    found = shutil.which("nvidia-cuda-mps-control")
    for folder in ("/usr/local/nvidia/bin", "/usr/bin", "/usr/local/cuda/bin"):
        candidate = Path(folder) / "nvidia-cuda-mps-control"
        if found is None and candidate.exists():
            found = str(candidate)
    if found is None:
        raise RuntimeError("ds_odc: GPU partitions need CUDA MPS, and this machine has no nvidia-cuda-mps-control "
                           "(it ships with the NVIDIA driver's utilities). Without it, ranks can only share the whole "
                           "GPU (DS_ODC_SHARED_GPU=1), which checks correctness but not speed between ranks.")
    return found


def partition_share(nproc: int) -> int:
    """The percentage of the SMs each of ``nproc`` ranks gets (their sum stays <= 100)."""
    if nproc < 1:
        raise ValueError(f"ds_odc: {nproc} partitions")
    return max(1, 100 // nproc)


@contextlib.contextmanager
def gpu_partitions(nproc: int) -> Iterator[dict[str, str]]:
    """Start an MPS control daemon of this user and yield the environment that puts each of ``nproc`` ranks on its
    partition of GPU 0 (add it to every rank's environment); stop the daemon on the way out, also after an error."""
    control = mps_control()
    folder = Path(tempfile.mkdtemp(prefix="ds_odc_mps_"))
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(folder / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(folder / "log")}
    for path in env.values():
        Path(path).mkdir()
    daemon_env = {**os.environ, **env}
    started = subprocess.run([control, "-d"], env=daemon_env, capture_output=True, text=True, timeout=60)
    try:
        if started.returncode != 0:
            raise RuntimeError(f"ds_odc: could not start the MPS daemon ({control} -d exited {started.returncode}): "
                               f"{(started.stderr or started.stdout).strip()}")
        yield {**env, _PERCENTAGE: str(partition_share(nproc)), "DS_ODC_SHARED_GPU": PARTITION}
    finally:
        with contextlib.suppress(Exception):
            subprocess.run([control], input="quit\n", env=daemon_env, capture_output=True, text=True, timeout=60)
            time.sleep(0.5)
        shutil.rmtree(folder, ignore_errors=True)


def check_partition_env() -> None:
    """In a rank of ``DS_ODC_SHARED_GPU=partition``: the MPS environment must have come with the process (CUDA reads
    it when it starts), or the rank would silently get the whole GPU."""
    missing = [k for k in (*_MPS_ENV, _PERCENTAGE) if not os.environ.get(k)]
    if missing:
        raise RuntimeError(f"ds_odc: DS_ODC_SHARED_GPU=partition, but {', '.join(missing)} is not set: start the job "
                           "under `python -m ds_odc.training.partition --nproc N -- <command>` (or gpu_partitions()), "
                           "which starts CUDA MPS and gives each rank its share of the SMs.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ds_odc.training.partition",
                                     description="Run a command with its ranks on SM partitions of GPU 0 (CUDA MPS).")
    parser.add_argument("--nproc", type=int, required=True, help="ranks (partitions) the command starts on GPU 0")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command, e.g. torchrun ...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --")
    with gpu_partitions(args.nproc) as env:
        return subprocess.run(command, env={**os.environ, **env}).returncode


if __name__ == "__main__":
    sys.exit(main())
