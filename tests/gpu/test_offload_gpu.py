"""The optimizer on the host (``offload_optimizer``) and ``offload_states()`` under ODC on GPUs (NVSHMEM transport):
the CPU scenarios of tests/zero/test_offload.py on CUDA, where the gradients cross to the host and the parameters
come back on copy streams while the CPU steps the other sub-groups.

    python -m pytest tests/gpu/test_offload_gpu.py -q
"""

from pathlib import Path

import pytest

from _launch import launch_gpu, rank_params  # tests/gpu is on sys.path (rootdir conftest)

ZERO = Path(__file__).resolve().parents[1] / "zero"
WORKER, OFFLOAD_WORKER = ZERO / "worker.py", ZERO / "offload_worker.py"

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

FACTOR, FP32_EPS = 4.0, 2.0 ** -23  # the rule of tests/zero/test_offload.py (within_rounding)


def run(script, nproc, *args, timeout=420):
    return launch_gpu(script, nproc, [str(a) for a in args], timeout=timeout).check().result


@pytest.mark.parametrize("nproc", rank_params(1, 2))
def test_bf16_offloaded_optimizer_matches_stock_with_the_same_offload_on_gpu(nvshmem_op, nproc):
    """bf16 shards, fp32 master and SGD on the host, equal counts, clipping active: ODC from stock within bf16
    resolution, no further from the fp32 answer than stock."""
    r = run(WORKER, nproc, "equal", "--offload", "both", "--bf16", "--optimizer", "sgd", "--clip", 0.05,
            "--reference-dtype", "float32")
    assert r["offloaded"] == [True, True] and r["optimizers"][1] == "OdcOptimizer", r
    assert r["max_rel_diff"] < 1e-2, r
    assert r["odc_vs_ref"] < 1.5 * r["stock_vs_ref"] + 1e-3, r


@pytest.mark.parametrize("nproc", rank_params(1, 2))
def test_fp32_offloaded_adamw_matches_stock_on_gpu(nvshmem_op, nproc):
    r = run(WORKER, nproc, "equal", "--offload", "both", "--optimizer", "adamw", "--clip", 0.05)
    assert r["offloaded"] == [True, True], r
    assert r["odc_vs_ref"] <= FACTOR * r["stock_vs_ref"] + FP32_EPS, r


@pytest.mark.parametrize("nproc", rank_params(2, 3))
def test_offloaded_optimizer_with_sampler_counts_on_gpu(nvshmem_op, nproc):
    """LB-Mini's uneven counts, fp32, optimizer on the host: as close to the float64 answer as one fp32 process (GPU
    pushes sum in any order, so not bit-equal to ODC on the device; a dropped microbatch still stands out)."""
    r = run(OFFLOAD_WORKER, nproc, "sampler", "--steps", 4)
    assert r["offloaded"] and r["host_step_ran"], r
    bound = FACTOR * r["ref32_vs_ref64"] + FP32_EPS
    assert r["offload_vs_ref64"] <= bound and r["offload_vs_device"] <= 2 * bound, r
    assert r["planted_vs_ref64"] > 100 * bound, r


@pytest.mark.parametrize("nproc", rank_params(2))
def test_offload_states_on_gpu(nvshmem_op, nproc):
    """NVSHMEM cannot give symmetric memory back: lp_params and lp_grads are refused with a message naming them;
    hp_params, optim_states and the gradient bucket move to the host and back bit for bit, as stock's."""
    refused = run(OFFLOAD_WORKER, nproc, "refused")
    for name in ("all", "lp_params", "lp_grads"):
        assert "cannot move" in refused[name] and "nvshmem" in refused[name], refused[name]
    assert refused["trains_after"] > 1e-3
    r = run(OFFLOAD_WORKER, nproc, "states", "--include", "hp_params,optim_states,contiguous_grad_buffer")
    for name, case in r["cases"].items():
        assert case["odc"]["changed"] == [] == case["stock"]["changed"], (name, case)
        assert case["odc"]["devices_offloaded"]["hp_params"] == ["cpu"] or "hp_params" not in name, (name, case)
    assert r["odc_vs_stock"] < 1e-4, r
