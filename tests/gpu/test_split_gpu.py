"""Split samples (lb-mini-sp) under ZeRO-3 + ODC on GPUs: the CPU scenario of tests/sp/split_worker.py on CUDA
(NVSHMEM transport, fp32; the ``ds_odc_sp`` attention's all-to-all over NCCL, or over gloo when the ranks share one
GPU), against one process training the same minibatches.

    python -m pytest tests/gpu/test_split_gpu.py -q
"""

from pathlib import Path

import pytest

from _launch import gpu_env, launch_gpu, rank_params  # tests/gpu is on sys.path (rootdir conftest)

WORKER = Path(__file__).resolve().parents[1] / "sp" / "split_worker.py"

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.mark.parametrize("nproc", rank_params(2))
def test_split_sample_matches_reference_on_gpu(nvshmem_op, nproc):
    r = launch_gpu(WORKER, nproc, ["train", "--model", "llama", "--checkpointing"], timeout=420).check().result
    assert r["moved"] > 1e-2, r
    assert r["max_rel_diff"] < 1e-4, r  # GPU reductions are not bit-identical to the reference's order
    for got, want in zip(r["losses"], r["ref_losses"]):
        assert abs(got - want) <= 1e-4 * abs(want), r
    assert r["splits"][0] == [[0, [0, 1]]]
