"""NVSHMEM transport on 2 GPUs, checked against NCCL (skipped without 2 CUDA GPUs).

One command on a 2-GPU machine:  python -m pytest tests/gpu/test_transport_gpu.py -q
Each path runs once in 2 ranks (torchrun, hard timeout); the tests below read the verdicts each rank wrote.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from _launch import needs_gpus, run_ranks  # tests/gpu is on sys.path (rootdir conftest)

pytestmark = [pytest.mark.gpu, pytest.mark.slow, needs_gpus(2)]

WORKER = Path(__file__).with_name("_transport_worker.py")
CHECKS = ["gather_bf16_bitwise", "gather_fp32_bitwise", "gather_bucket_side_stream", "scatter_fp32_vs_reduce_scatter",
          "scatter_bf16_vs_reduce_scatter", "mutual_100_rounds_exact", "uneven_rounds_exact", "bucket_300_params_exact",
          "closed"]
PATHS = ["p2p", "p2p-staging", "rma"]
_RUNS = {}


def _run(nvshmem_op, scenario: str, path: str):
    key = (scenario, path)
    if key not in _RUNS:
        _RUNS[key] = run_ranks(WORKER, ["--scenario", scenario, "--path", path], nproc=2, timeout_s=240)
    return _RUNS[key]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("check", CHECKS)
def test_transport_matches_nccl(nvshmem_op, path, check):
    run = _run(nvshmem_op, "main", path)
    for rank in (0, 1):
        verdict = run.results.get(rank, {}).get(check)
        assert verdict is not None, f"rank {rank} never reported {check!r}\n{run.describe()}"
        assert verdict["ok"], f"rank {rank}: {check} failed:\n{verdict['detail']}"


@pytest.mark.parametrize("path", ["p2p", "rma"])
def test_fence_timeout_names_missing_rank(nvshmem_op, path):
    run = _run(nvshmem_op, "fence-timeout", path)
    verdict = run.results.get(0, {}).get("fence_timeout")
    assert verdict is not None, f"rank 0 never reported\n{run.describe()}"
    assert verdict["ok"], verdict["detail"]
    assert "1" in verdict["detail"]


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")
def test_bringup_over_mpi(nvshmem_op):
    """Under mpirun, NVSHMEM comes up over mpi4py (no torchrun), and the transport still matches NCCL."""
    run = run_ranks(WORKER, ["--scenario", "main", "--path", "p2p"], nproc=2, timeout_s=90, launcher="mpirun")
    for rank in (0, 1):
        results = run.results.get(rank, {})
        assert results.get("bootstrap", {}).get("detail") == "mpi-uid", f"rank {rank}: {results}\n{run.describe()}"
        for check in CHECKS:
            assert results.get(check, {}).get("ok"), f"rank {rank}: {check}: {results.get(check)}\n{run.describe()}"
