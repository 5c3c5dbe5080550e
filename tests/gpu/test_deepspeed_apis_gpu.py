"""The DeepSpeed ZeRO-3 API sequences of tests/zero/deepspeed_apis_worker.py on GPUs (NVSHMEM transport), ODC against
stock ZeRO-3 in the same process, at 1, 2 and 3 ranks. On GPUs pushes add straight into the owners' accumulators, so
this is where zero_grad() before a step must empty them only once no peer can still push into them, and where a
gradient read between two microbatches must not see a fast peer's next one.

    python -m pytest tests/gpu/test_deepspeed_apis_gpu.py -q
"""

from pathlib import Path

import pytest

from _launch import launch_gpu, rank_params  # tests/gpu is on sys.path (rootdir conftest)

WORKER = Path(__file__).resolve().parents[1] / "zero" / "deepspeed_apis_worker.py"

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.mark.parametrize("nproc", rank_params(1, 2, 3))
def test_deepspeed_zero3_apis_match_stock_on_gpu(nvshmem_op, nproc, tmp_path):
    result = launch_gpu(WORKER, nproc, ["--dir", tmp_path], timeout=420).check().result
    moved = result.pop("stock_moved")
    assert moved and all(v > 1e-3 for v in moved.values()), moved
    worst = {k: v for k, v in result.items() if not v < 1e-4}  # GPU reductions are not bit-identical to stock's
    assert not worst, (worst, result)
