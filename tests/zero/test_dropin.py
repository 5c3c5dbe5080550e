"""Drop-in without silent differences: DeepSpeed's gradient and parameter APIs give the same answers with
``"odc": true`` as under stock ZeRO-3 when every rank runs the configured accumulation steps (see dropin_worker.py
for the sequence), and the early reads ODC cannot answer are refused with a reason."""

from pathlib import Path

import pytest

from _support.launch import launch
from _support.tolerance import assert_within
from _workload import api_comparisons

WORKER = Path(__file__).with_name("dropin_worker.py")
pytestmark = pytest.mark.slow

# SGD on a tiny model: ODC and stock differ only by the fp32 rounding of summing gradients in another order, held to
# the bounds of tests/_support/tolerance.py against stock's own rounding of the same kind of quantity (its distance
# from one process computing a step in float64); a missing or doubled push, a discarded microbatch that still
# counts, or a stale shard read gives differences of 1e-2 or more.


@pytest.mark.parametrize("nproc", [2, 3])
def test_gradient_and_parameter_apis_match_stock(nproc):
    result = launch(WORKER, nproc, ["apis"], timeout=300).check().result
    for rank, diffs in enumerate(result["ranks"]):
        assert all(v > 1e-3 for v in diffs.pop("stock_moved").values()), diffs
        assert_within(*api_comparisons(diffs, result["stock_rounding"], f"rank {rank}: "))


def test_early_reads_that_cannot_be_answered_are_refused():
    r = launch(WORKER, 2, ["refusals"], timeout=180).check().result
    assert r["explicit_mid_minibatch"].startswith("OdcError") and "middle of a minibatch" in r["explicit_mid_minibatch"]
    assert r["explicit_at_boundary"] == "no error"
    assert r["unmanaged"].startswith("OdcError") and "managed_gradient_accumulation=false" in r["unmanaged"]
