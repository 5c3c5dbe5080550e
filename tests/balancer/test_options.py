"""BalancerOptions (a trainer's balancer settings, checked when built) and choose_cost (the one place a cost choice
becomes a cost)."""

from __future__ import annotations

import pytest

from ds_odc.balancer import (AutoCost, BalancedBatchSampler, BalancerOptions, FittedCost, QuadraticCost, SplitPolicy,
                             TokenCost, auto_cost_prior, choose_cost, planning_cost)

CONFIG = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "vocab_size": 100}
LENGTHS = [5, 17, 9, 30, 4, 12, 22, 7, 15, 11, 26, 6, 3, 40, 8, 19]


def test_choose_cost_for_every_kind_of_choice():
    auto = choose_cost("auto", CONFIG, lag=3, auto_cost={"window": 8})
    assert isinstance(auto, AutoCost) and auto.lag == 3 and auto.window == 8
    assert auto.prior == auto_cost_prior(CONFIG)  # the model shape's FLOPs plus a microbatch's worth
    assert auto_cost_prior(None) == QuadraticCost(a=1.0, b=0.0, c=2048.0)  # without a shape: tokens
    mine = AutoCost(TokenCost(), lag=1)
    assert choose_cost(mine, CONFIG, lag=5) is mine  # an AutoCost keeps its own settings
    assert choose_cost("tokens") == TokenCost() and choose_cost(None) == TokenCost()
    assert choose_cost("quadratic", CONFIG) == QuadraticCost.from_hf_config(CONFIG)
    fitted = FittedCost(a=1.0, b=2.0, c=3.0)
    assert choose_cost(fitted) is fitted
    with pytest.raises(ValueError, match="derives its coefficients from the model's shape"):
        choose_cost("quadratic")
    with pytest.raises(ValueError, match="unknown cost model 'flops'"):
        choose_cost("flops")


def test_planning_cost_follows_the_fit():
    auto = choose_cost("auto", None, auto_cost={"warmup_steps": 0})
    assert planning_cost(auto) is auto.prior
    for step in range(5):  # busy time = 2 s per token + 1 s per microbatch, on two ranks (a fit needs 8 rows)
        auto.observe([10.0 + step, 30.0], [0.0, 0.0], [1.0, 3.0], [2 * (10.0 + step) + 1, 63.0])
    assert isinstance(planning_cost(auto), FittedCost) and planning_cost(auto) == auto.model
    assert planning_cost(TokenCost()) == TokenCost()


def test_the_sampler_chooses_its_cost_the_same_way():
    """cost="auto" in the sampler and an AutoCost from choose_cost plan alike and save the same state."""
    common = dict(world_size=2, rank=0, minibatch_size=4, max_tokens=40, model_config=CONFIG, seed=1)
    by_name = BalancedBatchSampler(LENGTHS, cost="auto", cost_lag=1, **common)
    given = BalancedBatchSampler(LENGTHS, cost=choose_cost("auto", CONFIG, lag=1), **common)
    assert [b.microbatches for b in by_name] == [b.microbatches for b in given]
    assert by_name.state_dict() == given.state_dict()
    with pytest.raises(ValueError, match="brings its own lag"):
        BalancedBatchSampler(LENGTHS, cost=AutoCost(TokenCost()), cost_lag=2, **common)


def test_options_are_checked_when_built():
    options = BalancerOptions()
    assert (options.planner, options.max_tokens, options.cost, options.oversize) == ("lb-mini", None, "auto", "error")
    assert options.sampler_options() == dict(planner="lb-mini", max_tokens=None, oversize="error", split=None)
    with pytest.raises(ValueError, match="unknown planner"):
        BalancerOptions(planner="lb-maxi")
    with pytest.raises(ValueError, match="unknown oversize policy"):
        BalancerOptions(oversize="drop")
    with pytest.raises(ValueError, match="max_tokens must be a positive int"):
        BalancerOptions(max_tokens=0)
    with pytest.raises(ValueError, match="unknown cost model 'flops'"):
        BalancerOptions(cost="flops")
    with pytest.raises(ValueError, match="unknown cost model 3"):
        BalancerOptions(cost=3)
    with pytest.raises(ValueError, match="SplitPolicy"):
        BalancerOptions(planner="lb-mini-sp", split={"max_group_size": 2})
    BalancerOptions(cost=AutoCost(TokenCost()))  # and "quadratic", whose model config comes later
    BalancerOptions(cost="quadratic")
    # The split policy reaches the sampler only for a planner that splits samples.
    policy = SplitPolicy()
    assert BalancerOptions(split=policy).sampler_options()["split"] is None
    assert BalancerOptions(planner="lb-mini-sp", split=policy).sampler_options()["split"] is policy
    with pytest.raises(Exception):  # frozen
        options.planner = "lb-micro"
