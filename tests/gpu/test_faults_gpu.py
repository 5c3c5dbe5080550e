"""Faults on the GPU path: a rank killed while its gradient push or parameter read is on the GPU, or stopped. Every
other rank must raise an error that names it within ``timeout_s`` (plus the rest of a tiny step), exit, and leave
nothing behind: no process, no shared-memory segment, no GPU context (tests/zero/worker.py ``fault``, 3 ranks
started without an agent, so that nobody else tears the survivors down).

    python -m pytest tests/gpu/test_faults_gpu.py -q

No ODC kernel waits for a peer: no signal, flag or barrier in device code, every loop bounded by the kernel's own task
table, and the only waiting is the fence's, on the host, with a timeout (``test_no_kernel_waits_for_a_peer``). The
one exception is the lock-step meeting of ``odc.lockstep`` (a baseline for measuring, off by default), whose wait ends
at a deadline on the device clock. Between
GPUs of one host a dead peer's memory stays mapped, so a push or read into it completes (the kill cases show it).
Across nodes the remote path's get/put complete through the NIC transport, whose handling of a dead node is
NVSHMEM's and is not exercised on one host.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from _launch import REPO, rank_params, run_plain_ranks  # tests/gpu is on sys.path (rootdir conftest)

WORKER = REPO / "tests" / "zero" / "worker.py"
TIMEOUT_S = 10.0
MARGIN_S = 20.0  # the rest of a tiny model's step, and the bring-up of gloo's error path
SURVIVORS = [0, 2]


def _gpu_pids() -> set[int] | None:
    """PIDs holding a context on a GPU, or None where nvidia-smi cannot tell."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return {int(x) for x in re.findall(r"\d+", out.stdout)}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _names_pid(name: str, pid: int) -> bool:
    """Whether a /dev/shm entry carries ``pid`` (CUDA's are named ``cuda.shm.<device>.<pid in hex>.<n>``)."""
    return re.search(rf"(^|\D){pid}(\D|$)", name) is not None or f".{pid:x}." in name


def _listing() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("nproc", rank_params(3))
@pytest.mark.parametrize("fault", ["kill-push", "kill-fetch", "stop"])
def test_survivors_name_the_faulty_rank_and_exit_clean(nvshmem_op, nproc, fault):
    before = _listing()
    run = run_plain_ranks(WORKER, ["fault", "--fault", fault, "--timeout", TIMEOUT_S], nproc,
                          deadline_s=240 if fault != "stop" else 300, wait_for=set(SURVIVORS))
    by_rank = {r["rank"]: r for r in run.results if "rank" in r}
    for rank in SURVIVORS:
        got = by_rank.get(rank)
        assert got is not None, f"rank {rank} reported nothing\n{run.log[-8000:]}"
        assert got["error_type"] == "FenceTimeout" and got["missing"] == [1], (got, run.log[-6000:])
        assert "1" in got["error"] and got["after_s"] <= TIMEOUT_S + MARGIN_S, got
        assert run.codes[rank] not in (None, 0), f"rank {rank} did not exit with an error: {run.codes}"
    alive = [r for r, pid in run.pids.items() if _alive(pid)]
    assert not alive, f"processes of ranks {alive} outlived the test"
    gpu = _gpu_pids()
    if gpu is not None:
        assert not gpu & set(run.pids.values()), f"GPU contexts left by {gpu & set(run.pids.values())}"
    survivors = [run.pids[r] for r in SURVIVORS]
    ours = {p for p in _listing() - before if "ds_odc" in p or any(_names_pid(p, pid) for pid in survivors)}
    assert not ours, f"the survivors left in /dev/shm: {sorted(ours)}"
    print(f"{fault}: " + ", ".join(f"rank {r} {by_rank[r]['error_type']} after {by_rank[r]['after_s']:.1f} s "
                                   f"(exit {run.codes[r]})" for r in SURVIVORS))


LOCKSTEP_KERNEL = "lockstep_barrier_kernel"  # odc.lockstep's meeting: it waits for peers, until a deadline


def test_no_kernel_waits_for_a_peer():
    """A kernel that waits on a signal or flag a peer sets would hang forever when that peer dies (no timeout
    reaches inside a kernel). ODC's kernels never wait: no NVSHMEM wait, barrier or fence in device code, and every
    loop runs over this rank's own task list. The lock-step meeting (``odc.lockstep``) must wait, and does so only in
    loops that end at a deadline taken from the device clock (``timeout_s`` after the kernel started)."""
    source = (REPO / "csrc" / "odc_kernels.cu").read_text()
    functions = (re.findall(r"__global__[^{]*\{.*?\n\}", source, re.S) +
                 re.findall(r"__device__[^{;]*\{.*?\n\}", source, re.S))
    lockstep = [f for f in functions if LOCKSTEP_KERNEL in f.split("{", 1)[0]]
    assert len(lockstep) == 1, f"found {len(lockstep)} definitions of {LOCKSTEP_KERNEL}"
    device_code = "\n".join(f for f in functions if f not in lockstep)
    assert device_code, "found no device code to check"
    waiting = re.findall(r"\b(nvshmem\w*(?:wait|barrier|fence|sync)\w*|__nanosleep|atomicCAS)\b", device_code)
    assert not waiting, f"device code waits on peers: {sorted(set(waiting))}"
    loops = re.findall(r"\b(while\s*\([^)]*\)|for\s*\([^;]*;[^;]*;[^)]*\))", device_code)
    unbounded = [loop for loop in loops if loop.startswith("while") and "lo < hi" not in loop]
    assert not unbounded, f"loops without a bound in device code: {unbounded}"
    meeting = lockstep[0]
    assert not re.findall(r"\bnvshmem\w*\(", meeting), "the lock-step meeting calls NVSHMEM's own waits"
    assert re.search(r"deadline\s*=\s*start\s*\+\s*timeout_ns", meeting) and \
        re.search(r"start\s*=\s*device_clock_ns\(\)", meeting), "the lock-step deadline is not on the device clock"
    waits = re.findall(r"\bwhile\s*\(([^)]*)\)", meeting)
    assert waits and all(w.strip().startswith("now < deadline") for w in waits), waits
    assert not re.findall(r"\bfor\s*\(\s*;", meeting), "a for loop without a bound in the lock-step meeting"
