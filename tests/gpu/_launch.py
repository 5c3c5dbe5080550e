"""Run a script on several local GPU ranks with torchrun, under a hard timeout, and collect what each rank reported.

Ranks get a GPU each when there are enough, and share GPU 0 otherwise (``DS_ODC_SHARED_GPU=1``: torch.distributed
over gloo, one NVSHMEM PE per process): :func:`rank_params` makes the test ids say which ("2ranks-shared",
"2ranks-2gpus"). Workers write ``rank<N>.json`` into the folder passed as ``--out``; a worker that hangs is killed
with its whole process group, so one stuck collective cannot stall the test session.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
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
    """Skip unless ``n`` CUDA GPUs are visible (for what several ranks sharing one GPU cannot show)."""
    return pytest.mark.skipif(gpu_count() < n, reason=f"needs {n} CUDA GPUs (found {gpu_count()})")


# NVSHMEM bring-up of two jobs starting at the same moment on one GPU sometimes fails in NVSHMEM's init (seen with
# pytest -n: "mapping of buffer object failed", "cuMemCreate failed"); such a launch is repeated once, with a warning.
BRINGUP_COLLISION = ("mapping of buffer object failed", "cuMemCreate failed")


def bringup_collided(log: str) -> bool:
    return any(sign in log for sign in BRINGUP_COLLISION)


# The test now running (set by tests/gpu/conftest.py): what its ranks report is attached to its report, so the
# measured numbers show at the end of the session and in --junitxml, not only the verdict.
RUNNING_TEST: list = []


def retried(run, log_of, what: str):
    """Run ``run()``; if its log shows an NVSHMEM bring-up collision, warn and run it once more."""
    result = run()
    if bringup_collided(log_of(result)):
        import warnings
        warnings.warn(f"NVSHMEM bring-up of {what} collided with a concurrent job; launched again")
        result = run()
    reported = getattr(result, "results", None)  # a launch's rank reports (a plain subprocess run has none)
    if RUNNING_TEST and reported:
        RUNNING_TEST[-1].user_properties.append(("measured", json.dumps(reported, default=str)))
    return result


def launch_gpu(script, nproc: int, args=(), timeout: float = 420, env: dict | None = None):
    """``_support.launch.launch`` for GPU ranks (:func:`gpu_env`), repeated once after a bring-up collision."""
    from _support.launch import launch
    return retried(lambda: launch(script, nproc, list(args), timeout=timeout, env={**gpu_env(nproc), **(env or {})}),
                   lambda r: r.stdout + r.stderr, f"{Path(script).name} at {nproc} ranks")


# ``ODC_TEST_GPU_PARTITIONS=1``: ranks that share GPU 0 run on SM partitions of it (CUDA MPS; ds_odc.training.partition)
# instead of sharing all its SMs, under the session's MPS daemon (tests/gpu/conftest.py). The test ids say "partitions".
PARTITIONS = os.environ.get("ODC_TEST_GPU_PARTITIONS", "").strip() == "1"
MPS: dict[str, str] = {}  # the session daemon's environment, while it runs


def placement(nproc: int) -> str:
    """How ``nproc`` ranks run on this machine: "<n>gpus" (one GPU each), "shared" (all on GPU 0), "partitions" (each
    on its share of GPU 0's SMs), or "none"."""
    if gpu_count() == 0:
        return "none"
    if gpu_count() >= nproc and nproc > 1:
        return f"{nproc}gpus"
    return "1gpu" if nproc == 1 else ("partitions" if PARTITIONS else "shared")


def rank_params(*counts: int, group: str | None = None) -> list:
    """``pytest.param(n)`` for each rank count, with an id that says where the ranks run; skipped without a GPU.
    ``group``: tests that read one cached launch stay on one worker under ``pytest -n N --dist loadgroup``."""
    def marks(n):
        skip = pytest.mark.skipif(gpu_count() == 0, reason="needs a CUDA GPU")
        return [skip, pytest.mark.xdist_group(f"{group}-{n}")] if group else [skip]
    return [pytest.param(n, id=f"{n}ranks-{placement(n)}", marks=marks(n)) for n in counts]


def gpu_env(nproc: int) -> dict[str, str]:
    """The environment of GPU ranks: CUDA for DeepSpeed and the test workers, multicast off, and the shared-GPU
    switch when there are fewer GPUs than ranks."""
    env = {"ODC_TEST_CUDA": "1", "DS_ACCELERATOR": "cuda", **NO_MULTICAST}
    if placement(nproc) == "shared":
        env["DS_ODC_SHARED_GPU"] = "1"
    elif placement(nproc) == "partitions":
        from ds_odc.training.partition import partition_share
        if not MPS:
            raise RuntimeError("ODC_TEST_GPU_PARTITIONS=1 but no MPS daemon runs (tests/gpu/conftest.py starts it)")
        env.update(MPS, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=str(partition_share(nproc)))
    return env


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
    """``launcher``: "torchrun", or "mpirun" (ranks get RANK/WORLD_SIZE from MPI's own variables). The ranks share a
    GPU when there are fewer GPUs than ranks (:func:`gpu_env`)."""
    env = {**gpu_env(nproc), **(env or {})}

    def run():
        with tempfile.TemporaryDirectory(prefix="ds_odc_gpu_") as out:
            return _run_ranks(script, args, nproc, timeout_s, env, launcher, out)
    return retried(run, lambda r: r.log, f"{Path(script).name} at {nproc} ranks")


def _run_ranks(script, args, nproc, timeout_s, env, launcher, out) -> RankRun:
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


@dataclass
class PlainRun:
    """N processes started without an agent (nobody tears the others down when one dies)."""

    results: list[dict]  # every result line any rank printed
    codes: dict[int, int | None]  # rank -> exit status (None: still running at the deadline, then killed)
    pids: dict[int, int]
    log: str


def run_plain_ranks(script: Path, args: list[str], nproc: int, deadline_s: float, env: dict | None = None,
                    wait_for: set[int] | None = None) -> PlainRun:
    """Start ``nproc`` ranks as independent processes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT set), wait up
    to ``deadline_s`` for the ranks in ``wait_for`` (default all), then SIGKILL whatever still runs."""
    return retried(lambda: _run_plain_ranks(script, args, nproc, deadline_s, env, wait_for), lambda r: r.log,
                   f"{Path(script).name} at {nproc} ranks")


def _run_plain_ranks(script, args, nproc, deadline_s, env, wait_for) -> PlainRun:
    from _support.launch import RESULT_PREFIX, cpu_env  # tests/ is on sys.path too
    base = cpu_env({**gpu_env(nproc), **(env or {})})
    base.update({"WORLD_SIZE": str(nproc), "MASTER_PORT": str(_free_port()), "ODC_TEST_DEADLINE_S": str(deadline_s)})
    procs, logs = {}, {}
    with tempfile.TemporaryDirectory(prefix="ds_odc_plain_") as folder:
        for rank in range(nproc):
            logs[rank] = open(Path(folder) / f"rank{rank}.log", "w+")
            procs[rank] = subprocess.Popen([sys.executable, str(script), *map(str, args)], stdout=logs[rank],
                                           stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                           env=dict(base, RANK=str(rank), LOCAL_RANK=str(rank),
                                                    LOCAL_WORLD_SIZE=str(nproc)))
        end = time.monotonic() + deadline_s
        codes: dict[int, int | None] = {}
        for rank in sorted(wait_for if wait_for is not None else procs):
            try:
                codes[rank] = procs[rank].wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[rank] = None
        for rank, proc in procs.items():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                codes.setdefault(rank, None)
            else:
                codes.setdefault(rank, proc.returncode)
        text = ""
        for rank in sorted(logs):
            logs[rank].seek(0)
            text += f"--- rank {rank} (exit {codes[rank]}) ---\n" + logs[rank].read()
            logs[rank].close()
    results = [json.loads(line[len(RESULT_PREFIX):]) for line in text.splitlines() if line.startswith(RESULT_PREFIX)]
    return PlainRun(results, codes, {r: p.pid for r, p in procs.items()}, text)
