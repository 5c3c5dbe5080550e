"""The stock DeepSpeed loop, balanced by ``zero_optimization.odc.balancer``: ``deepspeed.initialize(training_data=...)``
returns a loader of this rank's planned microbatches and ``loss = engine(**batch).loss; engine.backward(loss);
engine.step()`` trains the gradient of each minibatch's global token mean, with different microbatch counts per rank.

Equality: against one process computing the same minibatches (each sample alone), in fp32 and float64; the bound is
the fp32 reference's own distance from float64 (tests/_support/tolerance.py), and a planted wrong weight on one
microbatch must fail it. Misuse: a rank that skips ``engine.step()`` is named at that step, in the stock loop (by the
loader, on that rank) and in the hand-written loop over a sampler that does not tag (at the step's meeting).
"""

from pathlib import Path

import pytest

from _support.launch import launch
from _support.tolerance import assert_caught, assert_within, compare

WORKER = Path(__file__).with_name("planned_loop_worker.py")
pytestmark = pytest.mark.slow

CASES = {  # ranks, launcher, worker options
    "2ranks-deepspeed-eager-tokens": (2, "deepspeed", ["--cost", "tokens", "--seed", 5]),
    "3ranks-torchrun-varlen-auto": (3, "torchrun", ["--cost", "auto", "--seed", 6, "--attention", "ds_odc_varlen"]),
}


def _train(world: int, options: list, launcher: str = "plain") -> list[dict]:
    r = launch(WORKER, world, ["train", *options], timeout=240, launcher=launcher).check()
    by_rank = sorted(r.results, key=lambda x: x["rank"])
    assert [x["rank"] for x in by_rank] == list(range(world)), r.stdout[-3000:]
    return by_rank


@pytest.mark.parametrize("case", list(CASES))
def test_the_stock_loop_trains_the_global_mean_with_uneven_counts(case):
    world, launcher, options = CASES[case]
    ranks = _train(world, options, launcher)
    first = ranks[0]
    assert first["optimizer"] == "OdcOptimizer" and first["moved"] > 1e-2, first
    assert_within(compare(f"{case}: params vs one process", first["measured"], first["reference"]))
    for report in ranks:
        assert report["unread_warnings"] == 0, report  # the loader reads the balancer block
        assert report["steps"] == 3, report  # 3 full minibatches; the 3 samples left over are dropped
        counts = report["counts"]
        # what the engine answers under the plan: this rank's microbatches, the samples of the current one, and the
        # whole minibatch (4 per rank)
        assert [a[0] for a in report["answers"]] == [k for k in counts for _ in range(k)], report
        assert all(a[1] >= 1 and a[2] == 4 * world for a in report["answers"]), report
    if "tokens" in case:  # the plan is timing-free: ranks' counts must differ in some minibatch (here 2 of 3)
        per_step = list(zip(*(r["counts"] for r in ranks)))
        assert sum(len(set(c)) > 1 for c in per_step) >= 2, per_step
    else:  # the automatic cost: every step measured and gathered, the same record on every rank
        records = [r["last_step"] for r in ranks]
        assert records[0] is not None and all(rec == records[0] for rec in records), records
        assert len(records[0]["per_rank"]) == world and records[0]["num_samples"] == 4 * world, records[0]


def test_a_wrong_weight_fails_the_bound():
    first = _train(2, ["--cost", "tokens", "--seed", 5, "--plant"])[0]
    assert_caught(compare("planted: params vs one process", first["measured"], first["reference"]))


def test_a_rank_that_skips_the_step_is_named_at_that_step():
    """Rank 2 ends minibatch 1 without engine.step(): asking the loader for minibatch 2 raises on it at once, naming
    it; the others, waiting at minibatch 1's step, are told by the fence (its timeout, 8 s here) that rank 2 is
    missing."""
    r = launch(WORKER, 3, ["skip", "--victim", 2, "--timeout", 8, "--cost", "tokens", "--seed", 6], timeout=180,
               launcher="plain")
    by_rank = {x["rank"]: x for x in r.results}
    victim = by_rank[2]
    assert victim["error_type"] == "OdcError" and victim["step"] == 2 and victim["after_s"] < 2, victim
    assert "rank 2: the loop asked for the next minibatch without engine.step()" in victim["error"], victim
    for rank in (0, 1):
        report = by_rank.get(rank)
        assert report is not None and report["step"] == 1 and report["ranks"] == [2], (report, r.stderr[-4000:])


def test_an_untagged_sampler_loop_that_skips_the_step_is_named_at_that_step():
    """The hand-written loop of docs/USAGE.md over a BalancedBatchSampler without ``tag_minibatch``: the final short
    minibatch gives rank 2 no microbatch and it skips engine.step(). The sampler tags the step, so every rank fails at
    that step, naming rank 2 (before this, the update silently mixed two minibatches). The ds_config's balancer
    block, which this loop never reads, is named in one warning on every rank."""
    r = launch(WORKER, 3, ["sampler_skip", "--victim", 2, "--timeout", 30], timeout=180, launcher="plain")
    by_rank = {x["rank"]: x for x in r.results}
    assert sorted(by_rank) == [0, 1, 2], r.stdout[-3000:] + r.stderr[-4000:]
    for rank, report in by_rank.items():
        assert report["error_type"] == "MinibatchMismatch" and report["ranks"] == [2], report
        assert report["step"] == ([1, 0] if rank == 2 else [0, 2]), report
        assert report["after_s"] < 10, report
        assert "Rank 2 went past" in report["error"], report["error"]
        assert report["unread_warnings"] == 1, report
