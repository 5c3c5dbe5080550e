"""Run a script on several local GPUs with torchrun, under a hard timeout, and collect what each rank reported.

Workers write ``rank<N>.json`` into the folder passed as ``--out``; a worker that hangs is killed with its whole
process group, so one stuck collective cannot stall the test session.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
# NVLink multicast (NVLS) is never used by ds_odc, and must stay off on shared GPU hosts.
NO_MULTICAST = {"NVSHMEM_DISABLE_NVLS": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def needs_gpus(n: int):
    """Skip unless ``n`` CUDA GPUs are visible."""
    return pytest.mark.skipif(gpu_count() < n, reason=f"needs {n} CUDA GPUs (found {gpu_count()})")


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RankRun:
    returncode: int | None  # None when killed at the timeout
    results: dict[int, dict]  # rank -> what it wrote
    log: str

    def describe(self) -> str:
        return f"torchrun exit {self.returncode}; results from ranks {sorted(self.results)}\n--- log tail ---\n" \
               f"{self.log[-6000:]}"


def run_ranks(script: Path, args: list[str], nproc: int = 2, timeout_s: float = 240.0,
              env: dict[str, str] | None = None, launcher: str = "torchrun") -> RankRun:
    """``launcher``: "torchrun", or "mpirun" (ranks get RANK/WORLD_SIZE from MPI's own variables)."""
    out = tempfile.mkdtemp(prefix="ds_odc_gpu_")
    if launcher == "torchrun":
        # --standalone lets the rendezvous pick its own free port (choosing one here races with other launches)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    else:
        cmd = ["mpirun", "-n", str(nproc)]
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "OMPI_ALLOW_RUN_AS_ROOT": "1",
               "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", **(env or {})}
    cmd += [str(script), *args, "--out", out] if launcher == "torchrun" else [sys.executable, str(script), *args,
                                                                              "--out", out]
    child_env = dict(os.environ)
    child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), child_env.get("PYTHONPATH")]))
    child_env.setdefault("PYTHONUNBUFFERED", "1")
    child_env.setdefault("OMP_NUM_THREADS", "1")
    for key, value in NO_MULTICAST.items():
        child_env.setdefault(key, value)
    child_env.update(env or {})
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env,
                            start_new_session=True, cwd=REPO)
    try:
        log, _ = proc.communicate(timeout=timeout_s)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the group we started: torchrun and its workers
        log, _ = proc.communicate()
        log += f"\n[killed after {timeout_s:g} s]"
        code = None
    results = {}
    for path in Path(out).glob("rank*.json"):
        results[int(path.stem[4:])] = json.loads(path.read_text())
    return RankRun(code, results, log)
