"""Drop-in semantics on GPUs: DeepSpeed's gradient and parameter APIs between backward and step (reads after each
microbatch, one rank slow to copy what it read, writes, zero_grad, GatheredParameters with a slow modifier, replaced
shards) give stock ZeRO-3's answers with ODC on, and the early reads ODC cannot answer are refused
(tests/zero/dropin_worker.py, at 2 and 3 ranks).

    python -m pytest tests/gpu/test_dropin_gpu.py -q
"""

from pathlib import Path

import pytest

from _launch import launch_gpu, rank_params  # tests/gpu is on sys.path (rootdir conftest)

WORKER = Path(__file__).resolve().parents[1] / "zero" / "dropin_worker.py"

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

# The CPU test's bound is 1e-5; GPU reductions (atomics in any order, TF32 off) add fp32 rounding of that order.
TOLERANCE = 1e-4


@pytest.mark.parametrize("nproc", rank_params(2, 3))
def test_gradient_and_parameter_apis_match_stock_on_gpu(nvshmem_op, nproc):
    result = launch_gpu(WORKER, nproc, ["apis"], timeout=420).check().result
    for rank, diffs in enumerate(result["ranks"]):
        assert all(v > 1e-3 for v in diffs.pop("stock_moved").values()), diffs
        worst = {k: v for k, v in diffs.items() if not v < TOLERANCE}
        assert not worst, (rank, worst, diffs)


@pytest.mark.parametrize("nproc", rank_params(2))
def test_early_reads_that_cannot_be_answered_are_refused_on_gpu(nvshmem_op, nproc):
    r = launch_gpu(WORKER, nproc, ["refusals"], timeout=300).check().result
    assert r["explicit_mid_minibatch"].startswith("OdcError"), r
    assert r["explicit_at_boundary"] == "no error", r
    assert r["unmanaged"].startswith("OdcError"), r
