"""Hybrid sharding (``zero_optimization.odc.shard_size``) on GPUs: 4 ranks as 2 shard groups of 2 on the NVSHMEM
transport (a GPU each when there are 4, else all sharing GPU 0: one NVSHMEM PE per process), on the peer-pointer
path and on NVSHMEM get/put alone (``force_remote_path``: what a shard group spanning nodes would take), against one
process computing the same minibatches and against flat stock ZeRO-3; checkpoint resume; a rank of the other
group killed (tests/zero/hybrid_worker.py and worker.py, as the CPU tests in tests/zero/test_hybrid.py).

    python -m pytest tests/gpu/test_hybrid_gpu.py -q
"""


import pytest

from _launch import REPO, launch_gpu, rank_params, run_plain_ranks  # tests/gpu is on sys.path (rootdir conftest)

HYBRID = REPO / "tests" / "zero" / "hybrid_worker.py"
WORKER = REPO / "tests" / "zero" / "worker.py"
# The CPU tests hold 1e-6; GPU reductions (fp32 atomics in any order) add rounding of 1e-7..1e-6 per step.
TOLERANCE = 1e-4

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.mark.parametrize("nproc", rank_params(4))
@pytest.mark.parametrize("remote", [False, True], ids=["peer-pointers", "remote-path"])
def test_hybrid_matches_reference_and_flat_stock_on_gpu(nvshmem_op, nproc, remote, tmp_path):
    args = ["--shard-size", 2, "--checks", "uneven,equal,checkpoint", "--counts", "2,0,0,3", "--dir", tmp_path,
            *(["--remote"] if remote else [])]
    r = launch_gpu(HYBRID, nproc, [str(a) for a in args], timeout=600).check().result
    uneven = r["uneven"]
    assert uneven["transport_ranks"] == 2 and uneven["partition_groups"] == [[0, 1]], uneven
    assert uneven["moved"] > 1e-3 and uneven["max_rel_diff"] < TOLERANCE, uneven
    assert uneven["replicas_identical"], uneven  # the all-reduce gives every replica the same bits
    assert uneven["replica_sums"] == 3 and uneven["forward_backward_collectives"] == 0, uneven
    assert r["equal"]["max_rel_diff"] < TOLERANCE, r["equal"]
    ckpt = r["checkpoint"]
    assert ckpt["max_rel_diff"] < TOLERANCE and ckpt["loaded_vs_saved"] == 0.0, ckpt
    assert ckpt["consolidated_vs_saved"] == 0.0, ckpt
    assert len(ckpt["files"]) == 4, ckpt  # 2 shards x (model, optimizer): only the first group writes


@pytest.mark.parametrize("nproc", rank_params(4))
def test_dead_rank_in_another_group_is_named_on_gpu(nvshmem_op, nproc):
    """Rank 3 (second shard group) is killed in its second minibatch; rank 0 (first group) names it at the step."""
    run = run_plain_ranks(WORKER, ["fence_timeout", "--timeout", 15, "--kill", "--victim", 3, "--shard-size", 2],
                          nproc, deadline_s=300, wait_for={0})
    errors = [r for r in run.results if "error_type" in r]
    assert errors, run.log[-8000:]
    err = errors[-1]
    assert err["error_type"] == "FenceTimeout" and err["missing"] == [3], (err, run.log[-6000:])
    assert err["after_s"] < 15 + 20, err  # timeout_s plus the rest of a tiny step
