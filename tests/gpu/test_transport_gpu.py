"""NVSHMEM transport at 1, 2 and 3 ranks, checked against torch.distributed (NCCL with a GPU per rank, gloo when the
ranks share one GPU), exact integer sums and float64.

    python -m pytest tests/gpu/test_transport_gpu.py -q

One launch per rank count runs every path (peer pointers with vector atomics, peer pointers with staging slots,
NVSHMEM get/put only) on a transport of its own; the tests read the verdicts each rank wrote. With fewer GPUs than
ranks the ranks share GPU 0 as separate NVSHMEM PEs (the test id says "shared").
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from _launch import rank_params, run_ranks  # tests/gpu is on sys.path (rootdir conftest)

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

WORKER = Path(__file__).with_name("_transport_worker.py")
PATHS = ["p2p", "p2p-staging", "rma"]
CHECKS = ["gather_bf16_bitwise", "gather_fp32_bitwise", "gather_bucket_side_stream", "scatter_fp32_vs_reduce_scatter",
          "scatter_bf16_vs_reduce_scatter", "mutual_100_rounds_exact", "uneven_rounds_exact",
          "contention_fp32_vs_fp64", "contention_bf16_vs_fp64", "bucket_300_params_exact", "closed"]
DETERMINISTIC_PATHS = ["p2p-staging", "rma"]
_RUNS = {}


def _run(nvshmem_op, scenario: str, nproc: int, paths: str = ",".join(PATHS)):
    key = (scenario, nproc, paths)
    if key not in _RUNS:
        _RUNS[key] = run_ranks(WORKER, ["--scenario", scenario, "--paths", paths], nproc=nproc, timeout_s=300)
    return _RUNS[key]


def _verdicts(run, nproc, name):
    for rank in range(nproc):
        verdict = run.results.get(rank, {}).get(name)
        assert verdict is not None, f"rank {rank} never reported {name!r}\n{run.describe()}"
        assert verdict["ok"], f"rank {rank}: {name} failed:\n{verdict['detail']}"


@pytest.mark.parametrize("nproc", rank_params(1, 2, 3, group="transport"))
@pytest.mark.parametrize("path", PATHS)
def test_transport_matches_reference(nvshmem_op, nproc, path):
    run = _run(nvshmem_op, "main", nproc)
    for check in CHECKS:
        _verdicts(run, nproc, f"{path}/{check}")


@pytest.mark.parametrize("nproc", rank_params(2, 3, group="transport"))
@pytest.mark.parametrize("path", DETERMINISTIC_PATHS)
def test_source_ordered_paths_are_bit_reproducible(nvshmem_op, nproc, path):
    """The staging and RMA paths give bit-identical sums whatever order the pushes arrive in."""
    _verdicts(_run(nvshmem_op, "main", nproc), nproc, f"{path}/deterministic_repeat")


@pytest.mark.parametrize("nproc", rank_params(2, 3, group="transport"))
def test_remote_path_equals_peer_pointer_path(nvshmem_op, nproc):
    """NVSHMEM get/put alone (the multi-node path) sums the same pushes bit for bit like the peer-pointer staging
    path, and within fp32 rounding of the atomic path."""
    run = _run(nvshmem_op, "main", nproc)
    _verdicts(run, nproc, "rma_equals_p2p_staging_bitwise")
    _verdicts(run, nproc, "rma_matches_p2p_atomic")


@pytest.mark.parametrize("nproc", rank_params(2))
@pytest.mark.parametrize("path", ["p2p", "rma"])
def test_fence_timeout_names_missing_rank(nvshmem_op, nproc, path):
    run = _run(nvshmem_op, "fence-timeout", nproc, path)
    verdict = run.results.get(0, {}).get("fence_timeout")
    assert verdict is not None, f"rank 0 never reported\n{run.describe()}"
    assert verdict["ok"], verdict["detail"]
    assert "1" in verdict["detail"]


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")
@pytest.mark.parametrize("nproc", rank_params(2))
def test_bringup_over_mpi(nvshmem_op, nproc):
    """Under mpirun, NVSHMEM comes up over mpi4py (no torchrun), and the transport still matches the reference."""
    run = run_ranks(WORKER, ["--scenario", "main", "--paths", "p2p"], nproc=nproc, timeout_s=120, launcher="mpirun")
    for rank in range(nproc):
        results = run.results.get(rank, {})
        assert results.get("bootstrap", {}).get("detail") == "mpi-uid", f"rank {rank}: {results}\n{run.describe()}"
    for check in CHECKS:
        _verdicts(run, nproc, f"p2p/{check}")

