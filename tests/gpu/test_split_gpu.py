"""Split samples (lb-mini-sp) under ZeRO-3 + ODC on 2 GPUs: the CPU scenario of tests/sp/split_worker.py on CUDA
(NCCL groups, NVSHMEM transport, fp32), against one GPU training the same minibatches.

Run on a 2-GPU machine: ``python -m pytest tests/gpu/test_split_gpu.py -q``. Skipped without 2 CUDA GPUs.
"""

from pathlib import Path

from _support.launch import launch
from _launch import NO_MULTICAST, needs_gpus  # tests/gpu is on sys.path (rootdir conftest)

WORKER = Path(__file__).resolve().parents[1] / "sp" / "split_worker.py"
GPU_ENV = {"ODC_TEST_CUDA": "1", "DS_ACCELERATOR": "cuda", **NO_MULTICAST}

pytestmark = needs_gpus(2)


def test_split_sample_matches_reference_on_gpu(nvshmem_op):
    r = launch(WORKER, 2, ["train", "--model", "llama", "--checkpointing"], timeout=420, env=GPU_ENV).check().result
    assert r["moved"] > 1e-2, r
    assert r["max_rel_diff"] < 1e-4, r  # GPU reductions are not bit-identical to the reference's order
    for got, want in zip(r["losses"], r["ref_losses"]):
        assert abs(got - want) <= 1e-4 * abs(want), r
    assert r["splits"][0] == [[0, [0, 1]]]
