"""DeepSpeed's gradient-clipping sequence of tests/zero/grad_reads_worker.py on GPUs (NVSHMEM transport): the norm
groups read right after backward, every local gradient clamped and read again, then the step, ODC against stock
ZeRO-3 in the same process, fp32 and bf16, with and without ``offload_optimizer``. On GPUs pushes add straight into
the owners' accumulators as they arrive, so the first read must wait for every peer's.

    python -m pytest tests/gpu/test_gradient_reads_gpu.py -q
"""

from pathlib import Path

import pytest

from _launch import launch_gpu, rank_params  # tests/gpu is on sys.path (rootdir conftest)

WORKER = Path(__file__).resolve().parents[1] / "zero" / "grad_reads_worker.py"

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.mark.parametrize("nproc", rank_params(2, 3))
def test_grad_clip_sequence_reads_what_stock_reads_on_gpu(nvshmem_op, nproc):
    result = launch_gpu(WORKER, nproc, [], timeout=420).check().result
    for case, diffs in result["cases"].items():
        stock, odc = diffs["stock_norms"], diffs["odc_norms"]
        assert stock[0] > 0 and stock[1] < stock[0] and odc[1] < odc[0], (case, diffs)
        # GPU reductions are not bit-identical to stock's; bf16 reads differ by bf16's resolution (2**-8)
        limit = 1e-4 if case.startswith("fp32") else 1e-2
        worst = {k: v for k, v in diffs["odc_vs_stock"].items() if not v < limit}
        assert not worst, (case, worst, diffs)
