"""lb-mini-sp: which samples split, over which ranks, in which order, and what it buys in the simulator."""

import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ds_odc.balancer import plan_minibatch
from ds_odc.balancer.cost import FittedCost, QuadraticCost, TokenCost
from ds_odc.balancer.presets import get_preset
from ds_odc.balancer.simulate import main, simulate
from ds_odc.balancer.plan import SplitSample, odc_schedule, step_time
from ds_odc.balancer.sp import SplitPlan, SplitPolicy


def plan_split(lengths, world_size, **options):
    return plan_minibatch(lengths, world_size, planner="lb-mini-sp", **options)
from ds_odc.balancer.presets import MODEL_SHAPES

QWEN_1_5B = MODEL_SHAPES["qwen2.5-1.5b"]


def _runs_without_deadlock(plan: SplitPlan) -> bool:
    """Execute the plan as the ranks would: a rank runs its microbatches in order; a split sample's microbatch runs
    only when every member has reached it. True when every rank gets through its list."""
    groups = plan.groups
    pos = [0] * plan.world_size
    while True:
        moved = False
        for r, mbs in enumerate(plan.microbatches):
            while pos[r] < len(mbs) and mbs[pos[r]][0] not in groups:
                pos[r] += 1
                moved = True
            if pos[r] < len(mbs):
                i = mbs[pos[r]][0]
                if all(pos[m] < len(plan.microbatches[m]) and plan.microbatches[m][pos[m]] == [i]
                       for m in groups[i]):
                    for m in groups[i]:
                        pos[m] += 1
                    moved = True
        if all(p == len(m) for p, m in zip(pos, plan.microbatches)):
            return True
        if not moved:
            return False


@settings(max_examples=80, deadline=None)
@given(lengths=st.lists(st.integers(1, 4000), min_size=0, max_size=40), W=st.integers(1, 9),
       T=st.sampled_from([None, 500, 1500]), cost=st.sampled_from(["tokens", "quadratic"]))
def test_every_sample_once_or_on_its_whole_group_and_budgets_hold(lengths, W, T, cost):
    policy = SplitPolicy(ranks_per_node=4, num_attention_heads=12, num_key_value_heads=2)
    cm = TokenCost() if cost == "tokens" else QuadraticCost(a=1.0, b=1e-3)
    plan = plan_minibatch(lengths, W, planner="lb-mini-sp", max_tokens=T, cost=cm, oversize="truncate",
                          split=policy)
    assert isinstance(plan, SplitPlan) and plan.world_size == W
    groups = plan.groups
    seen = {}
    for r, mbs in enumerate(plan.microbatches):
        for mb in mbs:
            for i in mb:
                seen.setdefault(i, []).append(r)
            if mb and mb[0] in groups:
                assert len(mb) == 1  # a split sample is alone in its microbatch
            elif T is not None:
                assert sum(plan.effective_length(i, lengths) for i in mb) <= T
    assert sorted(seen) == list(range(len(lengths)))
    for i, ranks in seen.items():
        if i in groups:
            g = len(groups[i])
            assert sorted(ranks) == list(groups[i]) and g in policy.group_sizes(W)
            assert groups[i][0] % g == 0 and list(groups[i]) == list(range(groups[i][0], groups[i][0] + g))
            if T is not None:
                assert -(-plan.effective_length(i, lengths) // g) <= T  # every slice fits the budget
        else:
            assert len(ranks) == 1
    for r in range(W):  # split samples come first on every member, in the plan's order
        mine = [s.index for s in plan.splits if r in s.ranks]
        assert [mb[0] for mb in plan.microbatches[r][:len(mine)]] == mine
    assert _runs_without_deadlock(plan)
    assert plan.num_samples == len(lengths) and plan.num_tokens == sum(plan.effective_length(i, lengths)
                                                                       for i in range(len(lengths)))


def test_without_a_giant_sample_it_is_lb_mini():
    lengths = get_preset("long-sft").sample(256, seed=3).tolist()
    sp = plan_minibatch(lengths, 16, planner="lb-mini-sp", max_tokens=65536)
    mini = plan_minibatch(lengths, 16, planner="lb-mini", max_tokens=65536)
    assert sp.splits == () and sp.microbatches == mini.microbatches


def test_a_dominant_sample_is_split_over_the_smallest_group_that_fits_the_fair_share():
    lengths = [1000] + [100] * 30  # fair share (1000 + 3000) / 8 = 500
    plan = plan_split(lengths, 8, cost="tokens")
    assert plan.groups == {0: (0, 1, 2, 3)}  # 2 ways: 625 > the fair share; 4 ways: 312 <= (4000 + 250) / 8
    plan2 = plan_split(lengths, 8, cost="tokens", split=SplitPolicy(max_group_size=2))
    assert plan2.groups == {0: (0, 1)}  # 625 per member: the largest allowed group, still better than 1000


def test_splitting_must_beat_leaving_the_sample_whole():
    # 2 ranks, costs 2.2 and 1.8: splitting the 2.2 at efficiency 0.8 would give 1.375 + 1.8 on one rank
    assert plan_split([22, 18], 2, cost="tokens").splits == ()
    assert plan_split([30, 10], 2, cost="tokens").groups == {0: (0, 1)}  # 18.75 + 10 < 30


def test_samples_longer_than_max_tokens_split_so_every_slice_fits():
    plan = plan_split([5000] + [1000] * 20, 8, max_tokens=2048, cost="tokens")
    assert plan.groups == {0: (0, 1, 2, 3)}  # 5000 / 2 > 2048, 5000 / 4 <= 2048, and 4 ways fit the fair share
    assert plan_split([5000, 100, 100, 100], 8, max_tokens=2048, cost="tokens").groups[0] == tuple(range(8))
    with pytest.raises(ValueError, match=r"sample 0 has 20000 tokens, so even split over at most 8 ranks"):
        plan_split([20000, 100], 8, max_tokens=2048)
    cut = plan_split([20000, 100], 8, max_tokens=2048, oversize="truncate")
    assert cut.truncated == (0,) and cut.effective_length(0, [20000, 100]) == 8 * 2048
    assert cut.num_tokens == 8 * 2048 + 100


@pytest.mark.parametrize("heads,kv,want", [(12, 2, (2, 4)), (14, 2, (2,)), (28, 4, (2, 4)), (32, 8, (2, 4, 8)),
                                           (12, 3, ()), (16, 1, (2, 4, 8)), (None, None, (2, 4, 8))])
def test_group_sizes_follow_the_heads_as_ulysses_takes_them(heads, kv, want):
    policy = SplitPolicy(num_attention_heads=heads, num_key_value_heads=kv)
    assert policy.group_sizes(64) == want
    assert SplitPolicy(num_attention_heads=heads, num_key_value_heads=kv, ranks_per_node=4).group_sizes(64) == \
        tuple(g for g in want if g <= 4)
    assert policy.group_sizes(2) == tuple(g for g in want if g <= 2)


def test_a_model_whose_heads_allow_no_group_refuses_oversize_samples_saying_why():
    policy = SplitPolicy(num_attention_heads=12, num_key_value_heads=3)
    with pytest.raises(ValueError, match="not 2: 3 KV heads neither divide by 2 nor divide 2"):
        plan_split([5000, 100], 4, max_tokens=2048, split=policy)


def test_policy_from_a_model_config():
    policy = SplitPolicy.from_hf_config(QWEN_1_5B)
    assert (policy.num_attention_heads, policy.num_key_value_heads) == (12, 2)
    assert 0.05 < policy.exchange_per_token < 0.2  # all-to-all time per token vs its linear compute (H200 estimate)
    split4 = policy.member_cost(100.0, 1000, 4, 1.0)
    assert split4 > 100.0 / (4 * 0.8)  # the exchange adds to the compute share
    with pytest.raises(ValueError, match="efficiency"):
        SplitPolicy(efficiency=1.5)


def test_schedule_waits_for_the_whole_group_in_plan_order():
    splits = (SplitSample(0, (0, 1, 2, 3)), SplitSample(1, (0, 1)))
    times = [[4.0, 2.0, 1.0], [4.0, 2.0], [4.0, 1.0], [4.0]]
    assert odc_schedule(splits, times) == [[0.0, 4.0, 6.0], [0.0, 4.0], [0.0, 4.0], [0.0]]
    plan = plan_split([10, 1], 2, cost="tokens")
    assert step_time(plan.microbatch_costs("tokens", [10, 1]), "odc", plan.splits) == pytest.approx(10 / 1.6 + 1)


def test_plans_are_deterministic_and_fast_enough_to_compute_everywhere():
    lengths = get_preset("agent").sample(512, seed=1).tolist()
    cost = QuadraticCost.from_hf_config(QWEN_1_5B)
    policy = SplitPolicy.from_hf_config(QWEN_1_5B)
    a = plan_split(lengths, 64, max_tokens=32768, cost=cost, split=policy)
    b = plan_split(list(lengths), 64, max_tokens=32768, cost=cost, split=policy)
    assert a == b and a.splits


def test_agent_targets_at_64_and_512_ranks():
    """The issue's targets (simulated, agent preset, 8 samples per rank, no packing, Qwen2.5-1.5B quadratic cost,
    efficiency 0.8): lb-mini-sp's bubble <= 15% at 64 ranks and <= 20% at 512, counting the split samples' extra
    work as idle (work bubble), and a step at least 1.5x shorter than lb-mini's at 64 ranks."""
    cost, policy = QuadraticCost.from_hf_config(QWEN_1_5B), SplitPolicy.from_hf_config(QWEN_1_5B)
    for ranks, steps, target in ((64, 6, 0.15), (512, 2, 0.20)):
        res = simulate("agent", ranks=ranks, minibatch_size=8, max_tokens=None, cost=cost, steps=steps, seed=0,
                       planners=("lb-mini", "lb-mini-sp"), split=policy)
        mini, sp = res["lb-mini"], res["lb-mini-sp"]
        work_bubble = 1 - mini["busy_time_per_rank"] / sp["step_time"]  # lb-mini's busy time is the useful work
        assert sp["bubble_rate"] <= work_bubble <= target, (ranks, sp, work_bubble)  # measured 6.7% / 7.1%
        if ranks == 64:
            assert mini["step_time"] / sp["step_time"] >= 1.5, (mini, sp)  # measured 1.79x


def test_simulator_cli_reports_lb_mini_sp(capsys, tmp_path):
    png = tmp_path / "groups.png"
    rc = main(["--preset", "agent", "--ranks", "16", "--minibatch-size", "4", "--max-tokens", "0", "--cost",
               "quadratic", "--model-config", "qwen2.5-1.5b", "--plan-cost", "given", "--steps", "2", "--split",
               "--json", "--plot", str(png)])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) == {"local-sort", "lb-micro", "lb-mini", "lb-mini-sp"}
    assert data["lb-mini-sp"]["sync"] == "odc"
    assert data["lb-mini-sp"]["step_time"] < data["lb-mini"]["step_time"]
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_fitted_cost_in_seconds_prices_the_exchange_in_seconds():
    """The exchange is a multiple of the cost model's per-token term, so it scales with any unit."""
    policy = SplitPolicy(exchange_per_token=0.1)
    lengths = [4000] + [100] * 15
    a = plan_split(lengths, 8, cost=FittedCost(1.0, 1e-3, 0.0), split=policy)
    b = plan_split(lengths, 8, cost=FittedCost(1e-6, 1e-9, 0.0), split=policy)
    assert a.microbatches == b.microbatches and a.splits


def test_fit_sees_a_members_share_of_a_split_sample():
    plan = plan_split([10, 1], 2, cost="tokens")
    tokens, squares = plan.rank_loads([10, 1])
    assert sorted(tokens.tolist()) == pytest.approx(sorted([10 / 1.6, 10 / 1.6 + 1]))
    assert np.all(squares >= 100 / 1.6)


def test_sampler_gives_each_member_its_split_samples_and_the_same_normalisers():
    from ds_odc.balancer.sampler import BalancedBatchSampler
    lengths = [5000] + [300] * 15 + [4500] + [200] * 15  # 8 per rank per minibatch on 4 ranks: one giant each
    policy = SplitPolicy(num_attention_heads=4, num_key_value_heads=2)
    samplers = [BalancedBatchSampler(lengths, world_size=4, rank=r, minibatch_size=4, max_tokens=2048,
                                     planner="lb-mini-sp", cost="tokens", split=policy, shuffle=False)
                for r in range(4)]
    assert samplers[0].data_report.truncated.size == 0  # 5000 > max_tokens, but its 4 slices fit
    for step in range(2):
        batches = [s.minibatch(step) for s in samplers]
        giant = 0 if step == 0 else 16
        assert [b.splits for b in batches] == [{giant: (0, 1, 2, 3)}] * 4
        assert all(b.microbatches[0] == [giant] for b in batches)
        assert len({(b.num_samples, b.num_tokens) for b in batches}) == 1
        trained = sorted(i for b in batches for mb in b.microbatches for i in mb if i != giant)
        assert trained == [i for i in range(step * 16, step * 16 + 16) if i != giant]
    tokens, _ = samplers[0].load(batches[0].microbatches, batches[0].splits)
    rest = sum(lengths[i] for mb in batches[0].microbatches[1:] for i in mb)
    assert tokens == round(4500 / (4 * 0.8) + rest)
    with pytest.raises(ValueError, match="unknown planner"):
        BalancedBatchSampler(lengths, world_size=4, rank=0, minibatch_size=4, max_tokens=2048, planner="lb-sp")
