"""The shared-memory transport: exact one-sided accumulation under contention, exact gathers, no owner involvement,
and no files left in /dev/shm."""

import os
from pathlib import Path

import pytest

from _support.launch import launch

WORKER = Path(__file__).with_name("shm_worker.py")


def run(nproc, *args, timeout=180):
    return launch(WORKER, nproc, [str(a) for a in args], timeout=timeout).check().result


@pytest.mark.slow
def test_concurrent_accumulates_are_exact_and_leave_nothing_behind():
    r = run(4, "stress", "--rounds", 200)
    assert r["exact"] == [True] * 4
    assert r["sum"] == 0.0  # zeroed after the step
    if os.path.isdir("/dev/shm"):
        assert not [f for f in os.listdir("/dev/shm") if f.startswith(r["tag"])]


@pytest.mark.slow
def test_gather_equals_all_gather_bitwise():
    assert run(3, "gather")["bitwise_equal"] == [True] * 3


@pytest.mark.slow
def test_owner_does_nothing_to_serve_reads_and_pushes():
    r = run(3, "one_sided", "--sleep", 4)
    assert r["peers_done_while_owner_slept"] == [True, True]
    assert r["owner_received"] == r["expected"]
