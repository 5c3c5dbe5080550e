"""Hybrid sharding (``zero_optimization.odc.shard_size``) on CPU ranks: 4 ranks as 2 shard groups of 2 and 6 ranks
as 3 x 2, against one process computing the same minibatches and against flat stock ZeRO-3 (the same math: every
replica takes the step of the whole job's gradient). Each launch runs several checks of ``hybrid_worker.py``. The
equality bounds are those of tests/_support/tolerance.py: hybrid's distance from the fp32 one-process reference (or
from stock) against the reference's (stock's) own distance from float64."""

from pathlib import Path

import pytest

from _support.launch import launch
from _support.tolerance import assert_within, compare
from _workload import api_comparisons

HERE = Path(__file__).parent
pytestmark = pytest.mark.slow


def run(nproc, *args, timeout=300):
    return launch(HERE / "hybrid_worker.py", nproc, [str(a) for a in args], timeout=timeout).check().result


def vs_reference(r: dict, what: str):
    """Hybrid ODC against the fp32 one-process reference, against that reference's distance from float64."""
    return compare(f"{what}: parameters vs one process (max over tensors, relative)", r["max_rel_diff"],
                   r["ref_rounding"])


def vs_stock(r: dict):
    """Hybrid ODC against flat stock ZeRO-3, against stock's distance from the float64 one-process reference."""
    return compare("equal: parameters vs flat stock (max over tensors, relative)", r["max_rel_diff"],
                   r["stock_vs_ref"])


def check_uneven(r, world, shard):
    assert r["transport_ranks"] == shard and r["shard_groups"] == world // shard, r
    groups = [list(range(g * shard, (g + 1) * shard)) for g in range(world // shard)]
    assert r["partition_groups"] == [groups[0]], r  # rank 0 reports its own group: DeepSpeed partitions over it
    assert r["moved"] > 1e-3, r  # the steps changed the model, so agreeing with the reference means something
    assert_within(vs_reference(r, "uneven"))
    assert r["replicas_identical"], r
    assert r["replica_sums"] == 3, r  # one all-reduce per step
    assert r["forward_backward_collectives"] == 0, r  # reads and pushes are one-sided


def test_four_ranks_two_groups_of_two(tmp_path):
    """Uneven counts with a 0 in each group; drop-in vs flat stock ZeRO-3; checkpoint save/load/resume; zero.Init."""
    r = run(4, "--shard-size", 2, "--checks", "uneven,equal,checkpoint,zero_init", "--counts", "2,0,0,3",
            "--dir", tmp_path)
    check_uneven(r["uneven"], 4, 2)
    assert_within(vs_stock(r["equal"]))
    ckpt = r["checkpoint"]
    assert ckpt["max_rel_diff"] == 0.0 and ckpt["loaded_vs_saved"] == 0.0, ckpt
    assert ckpt["consolidated_vs_saved"] == 0.0, ckpt  # DeepSpeed's zero_to_fp32 reads the first group's files
    assert ckpt["files"] == [f"zero_pp_rank_{j}_mp_rank_00_{kind}_states.pt" for j in (0, 1)
                             for kind in ("model", "optim")], ckpt  # one copy: the replicas write nothing
    init = r["zero_init"]
    assert init["partition_sizes"] == [2], init  # zero.Init(config_dict_or_path=...) picked the shard group
    assert init["initial_same_everywhere"] and init["replicas_identical"], init
    assert_within(vs_reference(init, "zero_init"))
    assert "ValueError: ds_odc: zero_optimization.odc.shard_size=2" in init["refused"], init
    assert "partitioned by deepspeed.zero.Init over 4 ranks" in init["refused"], init


def test_six_ranks_three_groups_of_two():
    """A whole shard group with no microbatch at all still gets the step; drop-in vs flat stock ZeRO-3."""
    r = run(6, "--shard-size", 2, "--checks", "uneven,equal", "--counts", "3,1,0,0,2,1", timeout=420)
    check_uneven(r["uneven"], 6, 2)
    assert_within(vs_stock(r["equal"]))


def test_dead_rank_in_another_group_is_named_within_timeout_s():
    """Rank 3 (second shard group) dies in its second minibatch: rank 0 (first group) names it at the step."""
    r = launch(HERE / "worker.py", 4, ["fence_timeout", "--timeout", "15", "--kill", "--victim", 3,
                                       "--shard-size", 2], timeout=150, launcher="plain")
    err = r.results[-1]
    assert err["error_type"] == "FenceTimeout" and err["missing"] == [3], err
    assert err["after_s"] < 20, err  # within timeout_s (15 s) and the first step


def test_deepspeed_apis_match_flat_stock(tmp_path):
    """Gradients read and dropped between backward and step (early sums over the replicas, then more pushes),
    the 16-bit save and generation with the hooks off, hybrid vs flat stock ZeRO-3."""
    r = launch(HERE / "deepspeed_apis_worker.py", 4, ["--shard-size", 2, "--dir", tmp_path, "--only",
               "zero_grad_then_step,full_grads_read_repeated,save_16bit_model,unwrap_for_generation"],
               timeout=360).check().result
    moved, rounding = r.pop("stock_moved"), r.pop("stock_rounding")
    assert all(v > 1e-3 for v in moved.values()), moved
    assert_within(*api_comparisons(r, rounding))


def test_gradient_and_parameter_apis_match_flat_stock():
    """Gradients written between backward and step (then stepped, or added to by the next microbatch), dropped
    there, parameters written under GatheredParameters(modifier_rank=0) and safe_set_full_fp32_param: hybrid vs
    flat stock ZeRO-3, on every rank."""
    r = launch(HERE / "dropin_worker.py", 4, ["apis", "--shard-size", 2], timeout=360).check().result
    for rank, diffs in enumerate(r["ranks"]):
        assert all(v > 1e-3 for v in diffs.pop("stock_moved").values()), diffs
        assert_within(*api_comparisons(diffs, r["stock_rounding"], f"rank {rank}: "))
