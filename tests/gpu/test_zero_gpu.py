"""ZeRO-3 with ODC on GPUs (NVSHMEM transport): the CPU scenarios of tests/zero/worker.py on CUDA, bf16 and fp32, at
1, 2 and 3 ranks (a GPU each when there are enough, else sharing GPU 0: the test id says which).

    python -m pytest tests/gpu/test_zero_gpu.py -q
"""

from pathlib import Path

import pytest

from _launch import launch_gpu, rank_params  # tests/gpu is on sys.path (rootdir conftest)

WORKER = Path(__file__).resolve().parents[1] / "zero" / "worker.py"

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def run(nproc, *args, timeout=420, env=None):
    return launch_gpu(WORKER, nproc, [str(a) for a in args], timeout=timeout, env=env).check().result


@pytest.mark.parametrize("nproc", rank_params(1, 2, 3))
def test_bf16_odc_matches_stock_on_gpu(nvshmem_op, nproc):
    """odc on vs off in bf16 (SGD), equal counts: same parameters within bf16 resolution; no further from fp32 than
    stock."""
    r = run(nproc, "equal", "--bf16", "--optimizer", "sgd", "--reference-dtype", "float32")
    assert r["optimizers"] == ["DeepSpeedZeroOptimizer_Stage3", "OdcOptimizer"]
    assert r["max_rel_diff"] < 1e-2, r
    assert r["odc_vs_ref"] < 1.5 * r["stock_vs_ref"] + 1e-3, r
    assert max(abs(a - b) for a, b in zip(r["loss_stock"], r["loss_odc"])) < 2e-2


UNEVEN = list(zip(rank_params(1, 2, 2, 3), ["3", "3,1", "4,0", "2,0,3"]))


# one rank reads and pushes nothing remote: the remote path starts at 2 ranks
@pytest.mark.parametrize("nproc,counts,remote", [
    pytest.param(p.values[0], c, remote, id=f"{path}-{p.id}-{c}", marks=p.marks)
    for remote, path in [(False, "peer-pointers"), (True, "remote-path")] for p, c in UNEVEN
    if not (remote and p.values[0] == 1)])
def test_uneven_counts_match_reference_on_gpu(nvshmem_op, nproc, counts, remote):
    """fp32, uneven microbatch counts (zero included) vs a single-GPU computation of the same minibatches, on the
    peer-pointer path and on NVSHMEM get/put alone (force_remote_path)."""
    r = run(nproc, "uneven", "--counts", counts, "--clip", "0.05", *(["--remote"] if remote else []))
    assert r["optimizer"] == "OdcOptimizer"
    assert r["max_rel_diff"] < 1e-4, r  # GPU reductions are not bit-identical to the reference's order


@pytest.mark.parametrize("nproc", rank_params(2, 3))
def test_deterministic_runs_are_bit_identical(nvshmem_op, nproc):
    """"deterministic": true: two trainings of the same minibatches (uneven counts, ranks delayed differently, so
    pushes arrive in other orders) end with bit-identical parameters."""
    counts = "2,1" if nproc == 2 else "2,0,1"
    r = run(nproc, "repeatable", "--counts", counts)
    assert r["optimizer"] == "OdcOptimizer"
    assert r["runs_differ_bits"] == 0, r
    assert r["moved"] > 1e-3, r
