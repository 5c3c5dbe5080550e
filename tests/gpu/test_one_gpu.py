"""The NVSHMEM transport on one GPU (NVSHMEM with one PE): every path reads from and pushes into its own symmetric
memory, checked against NCCL at world size 1. With tests/gpu/test_zero_gpu.py's one-GPU cases (a few ODC training
steps against stock ZeRO-3 and a single-GPU reference), the smoke set for any CUDA machine:

    python -m pytest tests/gpu/test_one_gpu.py tests/gpu/test_zero_gpu.py -q
"""

from __future__ import annotations

from pathlib import Path

import pytest

from _launch import needs_gpus, run_ranks  # tests/gpu is on sys.path (rootdir conftest)

pytestmark = [pytest.mark.gpu, pytest.mark.slow, needs_gpus(1)]

TRANSPORT = Path(__file__).with_name("_transport_worker.py")
CHECKS = ["gather_bf16_bitwise", "gather_fp32_bitwise", "gather_bucket_side_stream", "scatter_fp32_vs_reduce_scatter",
          "scatter_bf16_vs_reduce_scatter", "mutual_100_rounds_exact", "bucket_300_params_exact", "closed"]


@pytest.mark.parametrize("path", ["p2p", "p2p-staging", "rma"])
def test_transport_on_one_pe_matches_nccl(nvshmem_op, path):
    run = run_ranks(TRANSPORT, ["--scenario", "main", "--path", path], nproc=1, timeout_s=180)
    results = run.results.get(0, {})
    for check in CHECKS:
        verdict = results.get(check)
        assert verdict is not None, f"never reported {check!r}\n{run.describe()}"
        assert verdict["ok"], f"{check} failed:\n{verdict['detail']}"
