"""NVSHMEM transport on 2 GPUs, checked against NCCL (skipped without 2 CUDA GPUs).

One command on a 2-GPU machine:  python -m pytest tests/gpu/test_transport_gpu.py -q
Each path runs once in 2 ranks (torchrun, hard timeout); the tests below read the verdicts each rank wrote.
"""

from __future__ import annotations

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
