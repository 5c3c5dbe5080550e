"""Multi-rank tests on CPU: launch N ranks under a hard timeout, and set each rank up to fail fast.

Every distributed test goes through :func:`launch`, so no test can hang: the launcher kills the whole process
group at the deadline, and :func:`init_test_ranks` gives the ranks a short process-group timeout and dumps Python
stacks shortly before the deadline. The ranks get a temporary folder of their own (``TMPDIR``), removed when they
end: torchrun's log folders and whatever a rank script leaves there go with it, even when the ranks were killed. A rank reports with :func:`emit` and ends with
:func:`ds_odc.training.distributed.shutdown_and_exit`.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

RESULT_PREFIX = "ODC_RESULT "
REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"


def cpu_env(extra: dict | None = None) -> dict:
    """The environment CPU ranks want: one thread each, loopback only, CPU accelerator, and the checkout plus
    ``tests/`` importable (rank scripts import ``_support`` too). The JIT cache is the suite's (tests/conftest.py
    sets ``TORCH_EXTENSIONS_DIR``), not the one torch shares between every environment of the user."""
    env = dict(os.environ)
    env.update({
        "OMP_NUM_THREADS": os.environ.get("ODC_TEST_THREADS", "1"),  # threads per rank (a reduction-order knob)
        "GLOO_SOCKET_IFNAME": "lo",
        "MASTER_ADDR": "127.0.0.1",
        "DS_ACCELERATOR": "cpu",
        "PYTHONWARNINGS": "ignore",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
    })
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), str(TESTS), env.get("PYTHONPATH", "")] if p)
    env.update(extra or {})
    return env


@dataclass
class LaunchResult:
    returncode: int
    stdout: str
    stderr: str
    results: list

    @property
    def result(self) -> dict:
        if not self.results:
            raise AssertionError(f"no {RESULT_PREFIX.strip()} line; rc={self.returncode}\n"
                                 f"--- stdout ---\n{self.stdout[-4000:]}\n--- stderr ---\n{self.stderr[-6000:]}")
        return self.results[-1]

    def check(self) -> "LaunchResult":
        if self.returncode != 0:
            raise AssertionError(f"ranks failed: rc={self.returncode}\n--- stdout ---\n{self.stdout[-4000:]}\n"
                                 f"--- stderr ---\n{self.stderr[-8000:]}")
        return self


def launch(script: str | os.PathLike, nproc: int = 2, args: list[str] | tuple = (), timeout: float = 240,
           launcher: str = "torchrun", env: dict | None = None) -> LaunchResult:
    """Run ``script`` on ``nproc`` CPU ranks and collect the JSON lines it printed with :func:`emit`.

    ``launcher``: ``torchrun`` (``--standalone``), ``deepspeed`` (the DeepSpeed launcher), ``mpirun`` (DeepSpeed
    discovers the ranks through mpi4py) or ``plain`` (N independent processes given RANK/WORLD_SIZE: no agent
    tears the others down when one dies, so what the survivors do is visible). Everything is killed after
    ``timeout`` seconds.
    """
    with tempfile.TemporaryDirectory(prefix="ds_odc_ranks_") as scratch:
        env = {"TMPDIR": scratch, "TMP": scratch, "TEMP": scratch, **(env or {})}
        return _launch(str(script), nproc, args, timeout, launcher, env)


def _launch(script: str, nproc: int, args, timeout: float, launcher: str, env: dict) -> LaunchResult:
    if launcher == "plain":
        return _launch_plain(script, nproc, args, timeout, env)
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script]
    elif launcher == "deepspeed":
        cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(nproc), "--master_port",
               str(_free_port()), script]
    elif launcher == "mpirun":
        mpirun = Path(sys.executable).with_name("mpirun")
        cmd = [str(mpirun) if mpirun.exists() else "mpirun", "-n", str(nproc), sys.executable, script]
    else:
        raise ValueError(f"unknown launcher {launcher!r}")
    cmd += [str(a) for a in args]
    full_env = cpu_env(env)
    full_env["ODC_TEST_DEADLINE_S"] = str(timeout)
    if launcher == "mpirun":  # a free port, not DeepSpeed's fixed 29500 that concurrent jobs would share
        full_env.setdefault("MASTER_PORT", str(_free_port()))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"ranks did not finish within {timeout} s (killed)\n--- stdout ---\n{out[-4000:]}\n"
                             f"--- stderr ---\n{err[-8000:]}")
    return LaunchResult(proc.returncode, out, err, _results(out))


def _launch_plain(script, nproc, args, timeout, env) -> LaunchResult:
    base = cpu_env(env)
    base.update({"WORLD_SIZE": str(nproc), "MASTER_PORT": str(_free_port()), "ODC_TEST_DEADLINE_S": str(timeout)})
    procs = []
    for rank in range(nproc):
        rank_env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nproc))
        procs.append(subprocess.Popen([sys.executable, script, *map(str, args)], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=rank_env, start_new_session=True))
    deadline = time.monotonic() + timeout
    outs, errs, codes, killed = [], [], [], []
    for rank, proc in enumerate(procs):
        try:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            killed.append(rank)
        outs.append(out)
        errs.append(f"[rank {rank} rc={proc.returncode}]\n{err}")
        codes.append(proc.returncode)
    if killed:
        raise AssertionError(f"ranks {killed} did not finish within {timeout} s (killed)\n" + "\n".join(errs)[-8000:])
    out = "\n".join(outs)
    return LaunchResult(max(codes, key=abs), out, "\n".join(errs), _results(out))


def _results(stdout: str) -> list:
    return [json.loads(line[len(RESULT_PREFIX):]) for line in stdout.splitlines() if line.startswith(RESULT_PREFIX)]


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def expect_error(fn) -> str:
    """Call ``fn`` and describe the error it raised ("no error" if none): for rank scripts that report refusals."""
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the point is to report it
        return f"{type(err).__name__}: {err}"
    return "no error"


def emit(payload: dict) -> None:
    """Print one result line for :func:`launch` to collect (call it on the rank that holds the result). One write of
    the whole line: ranks share the launcher's pipe, and ``print`` writes the text and its newline separately, so
    under an unbuffered stdout another rank's line could land between them (up to the pipe's atomic size, 4 KiB
    on Linux, a single write is never split)."""
    sys.stdout.flush()
    line = (RESULT_PREFIX + json.dumps(payload) + "\n").encode()
    while line:
        line = line[os.write(sys.stdout.fileno(), line):]


def init_test_ranks(timeout_s: float = 60.0) -> None:
    """A CPU rank under :func:`launch`: dump Python stacks 10 s before the launcher's deadline (so a killed run
    shows where it hung), then :func:`ds_odc.training.distributed.init_distributed` with a short process-group timeout."""
    from ds_odc.training.distributed import init_distributed
    deadline = float(os.environ.get("ODC_TEST_DEADLINE_S", "0"))
    if deadline > 15:
        faulthandler.dump_traceback_later(deadline - 10, exit=False)
    init_distributed(timeout_s=timeout_s)
