"""The DeepSpeed ZeRO-3 API sequences of tests/zero/deepspeed_apis_worker.py on GPUs (NVSHMEM transport), ODC against
stock ZeRO-3 in the same process. On GPUs pushes add straight into the owners' accumulators, so this is where
zero_grad() before a step must empty them only once no peer can still push into them.

    python -m pytest tests/gpu/test_deepspeed_apis_gpu.py -q        # skipped without enough CUDA GPUs
"""

from pathlib import Path

import pytest

from _support.launch import launch
from _launch import NO_MULTICAST, needs_gpus  # tests/gpu is on sys.path (rootdir conftest)

WORKER = Path(__file__).resolve().parents[1] / "zero" / "deepspeed_apis_worker.py"
GPU_ENV = {"ODC_TEST_CUDA": "1", "DS_ACCELERATOR": "cuda", **NO_MULTICAST}

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.mark.parametrize("nproc", [pytest.param(1, marks=needs_gpus(1), id="1gpu"),
                                   pytest.param(2, marks=needs_gpus(2), id="2gpu")])
def test_deepspeed_zero3_apis_match_stock_on_gpu(nvshmem_op, nproc, tmp_path):
    result = launch(WORKER, nproc, ["--dir", tmp_path], timeout=420, env=GPU_ENV).check().result
    moved = result.pop("stock_moved")
    assert moved and all(v > 1e-3 for v in moved.values()), moved
    worst = {k: v for k, v in result.items() if not v < 1e-4}  # GPU reductions are not bit-identical to stock's
    assert not worst, (worst, result)
