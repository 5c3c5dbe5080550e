"""ZeRO-3 with ODC on GPUs (NVSHMEM transport): the CPU scenarios of tests/zero/worker.py, on CUDA, bf16 and fp32,
on one GPU (NVSHMEM with one PE) and on two.

    python -m pytest tests/gpu/test_zero_gpu.py -q        # each case is skipped without enough CUDA GPUs
"""

from pathlib import Path

import pytest

from _support.launch import launch
from _launch import NO_MULTICAST, needs_gpus  # tests/gpu is on sys.path (rootdir conftest)

WORKER = Path(__file__).resolve().parents[1] / "zero" / "worker.py"
GPU_ENV = {"ODC_TEST_CUDA": "1", "DS_ACCELERATOR": "cuda", **NO_MULTICAST}
RANKS = [pytest.param(1, marks=needs_gpus(1), id="1gpu"), pytest.param(2, marks=needs_gpus(2), id="2gpu")]

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def run(nproc, *args, timeout=420):
    return launch(WORKER, nproc, [str(a) for a in args], timeout=timeout, env=GPU_ENV).check().result


@pytest.mark.parametrize("nproc", RANKS)
def test_bf16_odc_matches_stock_on_gpu(nvshmem_op, nproc):
    """odc on vs off in bf16 (SGD): same parameters within bf16 resolution; no further from fp32 than stock."""
    r = run(nproc, "equal", "--bf16", "--optimizer", "sgd", "--reference-dtype", "float32")
    assert r["optimizers"] == ["DeepSpeedZeroOptimizer_Stage3", "OdcOptimizer"]
    assert r["max_rel_diff"] < 1e-2, r
    assert r["odc_vs_ref"] < 1.5 * r["stock_vs_ref"] + 1e-3, r
    assert max(abs(a - b) for a, b in zip(r["loss_stock"], r["loss_odc"])) < 2e-2


@pytest.mark.parametrize("nproc,counts", [pytest.param(1, "3", marks=needs_gpus(1), id="1gpu-3"),
                                          pytest.param(2, "3,1", marks=needs_gpus(2), id="2gpu-3,1"),
                                          pytest.param(2, "4,0", marks=needs_gpus(2), id="2gpu-4,0")])
def test_uneven_counts_match_reference_on_gpu(nvshmem_op, nproc, counts):
    """fp32, uneven microbatch counts (zero included) vs a single-GPU computation of the same minibatches."""
    r = run(nproc, "uneven", "--counts", counts, "--clip", "0.05")
    assert r["optimizer"] == "OdcOptimizer"
    assert r["max_rel_diff"] < 1e-4, r  # GPU reductions are not bit-identical to the reference's order
