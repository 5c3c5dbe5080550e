"""ds_odc.training.launch: a launch past its time ends with every process it started, not only the launcher."""

import os
import sys
import textwrap
import time

import pytest

from ds_odc.training.launch import run_launch

# A launcher that starts two "ranks" (children that sleep) and waits for them, as torchrun does; each rank writes its
# pid so the test can look for it afterwards.
LAUNCHER = textwrap.dedent("""
    import subprocess, sys
    folder = sys.argv[1]
    rank = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); print('rank up', flush=True); time.sleep(120)"
    procs = [subprocess.Popen([sys.executable, "-c", rank, f"{folder}/rank{i}.pid"]) for i in range(2)]
    for p in procs:
        p.wait()
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (dead, not yet reaped by its new parent) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _pids(folder, n=2, wait_s=30.0):
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        files = [folder / f"rank{i}.pid" for i in range(n)]
        if all(f.exists() and f.read_text() for f in files):
            return [int(f.read_text()) for f in files]
        time.sleep(0.05)
    raise AssertionError("the ranks did not start")


def test_a_launch_past_its_time_ends_with_all_its_ranks(tmp_path):
    log = tmp_path / "launch.log"
    finished = run_launch([sys.executable, "-c", LAUNCHER, str(tmp_path)], timeout=3, log=log, grace_s=2)
    assert finished.timed_out and finished.returncode is None
    assert "time limit of 3 s" in finished.describe(3)
    pids = _pids(tmp_path)
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids), "a rank outlived its launch"
    assert "rank up" in log.read_text()  # what the ranks printed before the end is kept


def test_a_launch_that_finishes_returns_its_status_and_output():
    finished = run_launch([sys.executable, "-c", "print('hello'); raise SystemExit(3)"], timeout=60)
    assert (finished.returncode, finished.output.strip(), finished.timed_out) == (3, "hello", False)
    assert finished.describe(60) == "exited with status 3"
    assert run_launch([sys.executable, "-c", "pass"], timeout=60).describe(60).endswith("but wrote no result")
