"""lb-mini-sp: which samples split, over which ranks and in which shape, in which order, and what it buys."""

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ds_odc.balancer import plan_minibatch
from ds_odc.balancer.cost import FittedCost, QuadraticCost, TokenCost
from ds_odc.balancer.plan import SplitSample, odc_schedule, step_time
from ds_odc.balancer.presets import MODEL_SHAPES, get_preset
from ds_odc.balancer.simulate import main, simulate
from ds_odc.balancer.sp import SplitPlan, SplitPolicy

QWEN_1_5B = MODEL_SHAPES["qwen2.5-1.5b"]


def plan_split(lengths, world_size, **options):
    return plan_minibatch(lengths, world_size, planner="lb-mini-sp", **options)


def _step_and_bubble(plan, cost, lengths):
    mbc = plan.microbatch_costs(cost, lengths)
    t = step_time(mbc, "odc", plan.splits)
    return t, 1 - math.fsum(map(math.fsum, mbc)) / (plan.world_size * t) if t else 0.0


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
            shape = next(x for x in plan.splits if x.index == i)
            assert shape.ulysses == policy.ulysses_size(g) and g % shape.ulysses == 0
            assert shape.ulysses == 1 or policy.ulysses_limit(shape.ulysses) is None
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
    with pytest.raises(ValueError, match=r"sample 0 has 20000 tokens, so even split over the largest group, 8 ranks"):
        plan_split([20000, 100], 8, max_tokens=2048)
    cut = plan_split([20000, 100], 8, max_tokens=2048, oversize="truncate")
    assert cut.truncated == (0,) and cut.effective_length(0, [20000, 100]) == 8 * 2048
    assert cut.num_tokens == 8 * 2048 + 100


@pytest.mark.parametrize("heads,kv,ulysses", [(12, 2, (2, 4, 4, 4)), (14, 2, (2, 2, 2, 2)), (28, 4, (2, 4, 4, 4)),
                                              (32, 8, (2, 4, 8, 16)), (12, 3, (1, 1, 1, 1)), (16, 1, (2, 4, 8, 16)),
                                              (None, None, (2, 4, 8, 16))])
def test_any_group_size_is_ulysses_as_far_as_the_heads_allow_then_ring(heads, kv, ulysses):
    """Groups of 2..W ranks for every model; without exchange costs the Ulysses part is as large as the heads allow
    (as DeepSpeed's UlyssesSPAttentionHF takes them) and the rest is the ring."""
    policy = SplitPolicy(num_attention_heads=heads, num_key_value_heads=kv)
    assert policy.group_sizes(16) == (2, 4, 8, 16)
    assert SplitPolicy(max_group_size=4).group_sizes(64) == (2, 4) and policy.group_sizes(1) == ()
    assert tuple(policy.ulysses_size(g) for g in (2, 4, 8, 16)) == ulysses


def test_the_shape_is_the_cheapest_exchange_and_keeps_ulysses_inside_a_node():
    """With Qwen2.5-1.5B's exchange (12 query heads, 2 KV heads), moving k and v around a ring is cheaper than
    Ulysses' all-to-all of q, k, v and the output, until the ring crosses nodes; the chosen shape is the cheapest
    allowed one, and a group that spans nodes costs more per token than one inside a node."""
    policy = SplitPolicy.from_hf_config(QWEN_1_5B, ranks_per_node=8)
    for g in (2, 4, 8, 16, 64):
        allowed = [u for u in (1, 2, 4, 8, 16, 32, 64) if g % u == 0 and (u == 1 or policy.ulysses_limit(u) is None)]
        best = min(allowed, key=lambda u: (policy.exchange_per_member_token(g, u), -u))
        assert policy.ulysses_size(g) == best, g
        assert policy.ulysses_size(g) <= 8  # Ulysses never crosses a node
    inside = policy.member_cost(0.0, 1000, 8, 1.0)
    across = SplitPolicy.from_hf_config(QWEN_1_5B, ranks_per_node=4).member_cost(0.0, 1000, 8, 1.0)
    assert across > inside > 0


def test_a_model_whose_heads_allow_no_ulysses_splits_over_a_ring():
    policy = SplitPolicy(num_attention_heads=12, num_key_value_heads=3)
    plan = plan_split([5000, 100], 4, max_tokens=2048, split=policy)
    assert [(s.ranks, s.shape) for s in plan.splits] == [((0, 1, 2, 3), "1x4")]


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


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 6000), min_size=1, max_size=48), W=st.sampled_from([2, 3, 4, 8, 16]),
       T=st.sampled_from([None, 6000, 9000]), fixed=st.sampled_from([0.0, 300.0]), heads=st.sampled_from([3, 4, 12]))
def test_never_a_longer_step_or_a_larger_bubble_than_lb_mini(lengths, W, T, fixed, heads):
    """Whatever it splits, the plan's step and bubble (under the cost it planned with) are no worse than lb-mini's
    plan of the same samples, each trained whole (every sample fits max_tokens here)."""
    cost = FittedCost(1.0, 2e-3, fixed)
    policy = SplitPolicy(num_attention_heads=heads, num_key_value_heads=1, ranks_per_node=4,
                         exchange_per_token=0.05, exchange_per_kv_head=0.01)
    sp = plan_split(lengths, W, max_tokens=T, cost=cost, split=policy)
    mini = plan_minibatch(lengths, W, planner="lb-mini", max_tokens=T, cost=cost)
    (t_sp, b_sp), (t_mini, b_mini) = _step_and_bubble(sp, cost, lengths), _step_and_bubble(mini, cost, lengths)
    assert t_sp <= t_mini * (1 + 1e-9) and b_sp <= b_mini + 1e-9


def test_no_member_exceeds_the_fair_share_when_that_is_possible():
    """heavy-tail at 64 ranks (8 samples each, quadratic cost): every member's share of a split sample fits in the
    fair share, and the step stays within 15% of it although some samples cost up to ~10 fair shares whole."""
    cost, policy = QuadraticCost.from_hf_config(QWEN_1_5B), SplitPolicy.from_hf_config(QWEN_1_5B)
    rng = np.random.default_rng(1)
    for _ in range(4):
        lengths = get_preset("heavy-tail").sample(512, rng)
        plan = plan_split(lengths, 64, cost=cost, split=policy)
        c = cost.sample_costs(lengths)
        fair = sum(map(sum, plan.microbatch_costs(cost, lengths))) / 64  # the split overheads included
        assert plan.splits and c.max() > 2 * fair
        for s in plan.splits:
            assert policy.member_cost(c[s.index], lengths[s.index], s.size, cost.a, s.ulysses) <= fair
        assert _step_and_bubble(plan, cost, lengths)[0] <= 1.15 * fair


TARGET_SHAPE = dict(minibatch_size=8, cost=QuadraticCost.from_hf_config(QWEN_1_5B), plan_cost="given",
                    planners=("lb-mini", "lb-mini-sp"), split=SplitPolicy.from_hf_config(QWEN_1_5B))


@pytest.mark.parametrize("preset,ranks,target", [("heavy-tail", 8, 0.05), ("heavy-tail", 64, 0.15),
                                                 ("agent", 64, 0.02)])
def test_bubble_targets_without_a_budget(preset, ranks, target):
    """The simulated targets (8 samples per rank, no packing, Qwen2.5-1.5B quadratic cost, efficiency 0.8):
    lb-mini-sp's bubble <= 5% at 8 ranks and <= 15% at 64 on heavy-tailed lengths, <= 2% on agent at 64; and its
    step far shorter than lb-mini's, whose bubble is the balance bound there."""
    res = simulate(preset, ranks=ranks, max_tokens=None, steps=6, seed=1, **TARGET_SHAPE)
    mini, sp = res["lb-mini"], res["lb-mini-sp"]
    assert sp["bubble_rate"] <= target, sp  # measured 0.0-0.1%
    assert sp["bubble_rate"] <= sp["work_bubble_rate"] <= 0.16, sp  # the overhead counted idle: 3-13%
    assert mini["step_time"] / sp["step_time"] >= 1.25, (mini, sp)  # measured 1.35-10x


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_with_any_token_budget_no_worse_than_lb_mini_plus_one_point(seed):
    """heavy-tail at 64 ranks: with budgets of 8k-64k tokens lb-mini truncates the long samples, lb-mini-sp trains
    them whole over groups; its bubble stays within one point of lb-mini's."""
    for T in (8192, 16384, 32768, 65536):
        res = simulate("heavy-tail", ranks=64, max_tokens=T, steps=4, seed=seed, **TARGET_SHAPE)
        assert res["lb-mini-sp"]["bubble_rate"] <= res["lb-mini"]["bubble_rate"] + 0.01, (T, res)


def test_heavy_tail_preset_is_heavier_than_agent():
    """At 64 ranks the costliest heavy-tail sample usually costs more than 8 ranks' fair share (quadratic cost);
    agent's rarely does."""
    cost = QuadraticCost.from_hf_config(QWEN_1_5B)

    def dominant(preset):
        rng = np.random.default_rng(0)
        ratios = [c.max() / (c.sum() / 64) for c in (cost.sample_costs(get_preset(preset).sample(512, rng))
                                                     for _ in range(40))]
        return np.mean(np.asarray(ratios) > 8)

    assert dominant("heavy-tail") > 0.6 > 0.1 > dominant("agent")


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


def test_max_ulysses_size_caps_the_heads_part():
    policy = SplitPolicy(num_attention_heads=32, num_key_value_heads=8, max_ulysses_size=2)
    assert [policy.ulysses_size(g) for g in (2, 4, 8)] == [2, 2, 2]
    assert SplitPolicy(max_ulysses_size=1).ulysses_size(8) == 1
    with pytest.raises(ValueError, match="max_ulysses_size"):
        SplitPolicy(max_ulysses_size=0)
