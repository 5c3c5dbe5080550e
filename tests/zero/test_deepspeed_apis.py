"""DeepSpeed ZeRO-3 APIs the way DeepSpeed's own unit tests use them give the same answers with ``"odc": true`` as
under stock ZeRO-3 (the sequences are in deepspeed_apis_worker.py): zero_grad() before a step with no backward in
between, repeated backward passes read through get_fp32_grad_partitions(), save_16bit_model(), and
unwrap_model_for_generation()."""

from pathlib import Path

import pytest

from _support.launch import launch
from _support.tolerance import assert_within
from _workload import api_comparisons

WORKER = Path(__file__).with_name("deepspeed_apis_worker.py")
pytestmark = pytest.mark.slow

# SGD on a tiny model: ODC and stock differ only by the fp32 rounding of summing gradients in another order, held to
# the bounds of tests/_support/tolerance.py against stock's own rounding of the same kind of quantity (its distance
# from one process computing a step in float64); a dropped or stale gradient or a stale shard gives differences of
# 1e-2 or more.


@pytest.mark.parametrize("nproc", [2, 3])
def test_deepspeed_zero3_apis_match_stock(nproc, tmp_path):
    result = launch(WORKER, nproc, ["--dir", tmp_path], timeout=300).check().result
    moved, rounding = result.pop("stock_moved"), result.pop("stock_rounding")
    assert moved and all(v > 1e-3 for v in moved.values()), moved
    assert_within(*api_comparisons(result, rounding))
