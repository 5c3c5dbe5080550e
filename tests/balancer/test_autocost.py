"""The automatic cost: recovery of known coefficients, plans as good as the truth's, robustness, rank agreement,
and resume through the sampler's state_dict."""

import json

import numpy as np
import pytest

from ds_odc.balancer import FittedCost, QuadraticCost, plan_minibatch
from ds_odc.balancer.autocost import AutoCost
from ds_odc.balancer.presets import get_preset
from ds_odc.balancer.sampler import BalancedBatchSampler, auto_cost_prior

TRUTH = dict(a=2e-5, b=1e-9, c=0.3, d=0.5)  # seconds: per token, per token^2, per microbatch, per step
PRIOR = QuadraticCost(a=1.0, b=1 / 30000, c=2048.0)  # a model-shape prior: right form, wrong scale and mix


def rank_step(rng, truth=TRUTH, noise=0.0, max_samples=6):
    lengths = rng.integers(1000, 30000, size=rng.integers(1, max_samples))
    T, S, M = int(lengths.sum()), float((lengths ** 2).sum()), len(lengths)
    busy = truth["a"] * T + truth["b"] * S + truth["c"] * M + truth["d"]
    return T, S, M, busy * (1 + noise * rng.standard_normal())


def observe_steps(fit, steps, ranks, rng, noise=0.0, spoil=None):
    for step in range(steps):
        T, S, M, busy = map(list, zip(*(rank_step(rng, noise=noise) for _ in range(ranks))))
        if spoil:
            busy = spoil(step, busy)
        update = fit.observe(T, S, M, busy)
    return update


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_recovers_known_coefficients_within_10_percent(seed):
    """8 ranks, 30 steps, 3% noise on every busy time: a, b, c, d each within 10% of the truth."""
    update = observe_steps(AutoCost(PRIOR), 30, 8, np.random.default_rng(seed), noise=0.03)
    assert update.fitted and update.steps_used == 29  # the warm-up step is left out
    for name, true in TRUTH.items():
        assert getattr(update, name) == pytest.approx(true, rel=0.10), (name, update)


def test_no_coefficients_before_a_fit_exists():
    """Until the fit replaces the prior an update carries no a, b, c, d (they would be the prior's FLOPs, not
    seconds); the prior is there, labelled. The first fitted update's coefficients are seconds of the right size."""
    fit = AutoCost(PRIOR)
    rng = np.random.default_rng(5)
    updates = [observe_steps(fit, 1, 2, rng) for _ in range(8)]
    early, late = updates[0], updates[-1]
    assert not early.fitted and (early.a, early.b, early.c, early.d) == (None, None, None, None)
    assert early.prior == PRIOR.coefficients() and early.as_dict()["a"] is None
    assert late.fitted and late.a == pytest.approx(TRUTH["a"], rel=0.5), late  # seconds per token, not FLOPs


def test_plans_with_the_fit_are_within_2_percent_of_the_truths():
    """Planned with the fitted cost, the true step time (ODC: the slowest rank's true busy time) of lb-mini over 20
    long-tail minibatches is within 2% of what plans made with the true cost achieve."""
    fit = AutoCost(PRIOR)
    observe_steps(fit, 30, 8, np.random.default_rng(3), noise=0.03)
    truth = FittedCost(TRUTH["a"], TRUTH["b"], TRUTH["c"])
    rng = np.random.default_rng(4)
    times = {"fit": 0.0, "truth": 0.0, "prior": 0.0}
    for _ in range(20):
        lengths = get_preset("baselines-longtail").sample(32, rng).tolist()
        for name, cost in (("fit", fit.model), ("truth", truth), ("prior", PRIOR)):
            plan = plan_minibatch(lengths, 8, planner="lb-mini", max_tokens=None, cost=cost)
            times[name] += max(plan.rank_costs(truth, lengths))
    assert times["fit"] <= 1.02 * times["truth"], times
    assert times["prior"] > 1.05 * times["truth"], times  # the test can fail: the prior alone plans worse


def test_outlier_steps_are_left_out():
    """A profiled step (3x slower on every rank) and a step where one rank stalled do not move the fit."""
    def spoil(step, busy):
        if step == 7:
            return [3 * b for b in busy]
        if step == 12:
            return busy[:1] + [busy[1] + 5.0] + busy[2:]
        return busy

    clean = observe_steps(AutoCost(PRIOR), 25, 8, np.random.default_rng(5), noise=0.02)
    spoilt = observe_steps(AutoCost(PRIOR), 25, 8, np.random.default_rng(5), noise=0.02, spoil=spoil)
    assert spoilt.outlier_steps == 2 and clean.outlier_steps == 0
    for name in ("a", "b", "c"):  # the same fit but for two clean steps fewer
        assert getattr(spoilt, name) == pytest.approx(getattr(clean, name), rel=0.05)
    kept = observe_steps(AutoCost(PRIOR, outlier_factor=1e9), 25, 8, np.random.default_rng(5), noise=0.02,
                         spoil=lambda s, b: [3 * x for x in b] if s == 7 else b)
    assert abs(kept.a / clean.a - 1) > 0.1  # without the outlier test the profiled step would distort the fit


def test_every_rank_computes_the_same_bits_from_permuted_rows():
    rng = np.random.default_rng(6)
    steps = [list(zip(*(rank_step(rng, noise=0.05) for _ in range(16)))) for _ in range(12)]
    fits = [AutoCost(PRIOR) for _ in range(3)]
    perms = np.random.default_rng(7)
    for cols in steps:
        for k, fit in enumerate(fits):
            order = np.arange(16) if k == 0 else perms.permutation(16)
            fit.observe(*([col[i] for i in order] for col in cols))
    coefs = [f.model.coefficients() for f in fits]
    assert coefs[0] == coefs[1] == coefs[2]  # exact equality, not approx


def test_prior_until_enough_data_and_collinear_counts_stay_solvable():
    """Before min_steps (after warm-up) the plan uses the prior; when every rank always runs the same number of
    microbatches c and d cannot be told apart, and the fit still returns finite, non-negative coefficients that
    predict the busy time."""
    fit = AutoCost(PRIOR, min_steps=3)
    rng = np.random.default_rng(8)
    for step in range(4):
        assert fit.model == PRIOR
        T, S, _, _ = zip(*(rank_step(rng) for _ in range(4)))
        fit.observe(T, S, [4] * 4, [TRUTH["a"] * t + TRUTH["b"] * s + 4 * TRUTH["c"] + TRUTH["d"]
                                     for t, s in zip(T, S)])
    assert fit.model != PRIOR
    update = fit.last_update
    assert min(update.a, update.b, update.c) >= 0
    assert update.c * 4 + update.d == pytest.approx(4 * TRUTH["c"] + TRUTH["d"], rel=0.01)


def _run(sampler, steps, state_at=None):
    """Train `steps` minibatches with synthetic busy times that follow TRUTH, with noise drawn per (step, rank) so
    that the same plan always meets the same timings; returns the plans and the state after `state_at` steps."""
    plans, saved = [], None
    for batch in sampler:
        plans.append(batch.microbatches)
        rows = []  # every rank's numbers of this step, as gather_step gives them to every rank
        for r in range(sampler.world_size):
            mine = batch if r == sampler.rank else _peer(sampler, batch.step, r)
            tokens, sq = sampler.load(mine.microbatches)
            busy = TRUTH["a"] * tokens + TRUTH["b"] * sq + TRUTH["c"] * len(mine.microbatches) + TRUTH["d"]
            noise = np.random.default_rng([batch.epoch, batch.step, r]).standard_normal()
            rows.append({"tokens": tokens, "sq_tokens": sq, "microbatches": len(mine.microbatches),
                         "busy_s": busy * (1 + 0.03 * noise)})
        sampler.observe(rows)
        if len(plans) == state_at:
            saved = json.loads(json.dumps(sampler.state_dict()))  # a checkpoint is JSON
        if len(plans) == steps:
            break
    return plans, saved


def _peer(sampler, step, rank):
    other = BalancedBatchSampler(sampler.lengths, world_size=sampler.world_size, rank=rank,
                                 minibatch_size=sampler.minibatch_size, max_tokens=sampler.max_tokens,
                                 planner=sampler.planner, seed=sampler.seed, cost_lag=sampler.auto.lag)
    other.load_state_dict(sampler.state_dict())
    return other.minibatch(step)


LENGTHS = get_preset("baselines-longtail").sample(400, seed=11).tolist()


def _auto_sampler(**kw):
    return BalancedBatchSampler(LENGTHS, world_size=4, rank=1, minibatch_size=4, max_tokens=None, seed=2, **kw)


def test_auto_is_the_default_and_learns_the_plans():
    sampler = _auto_sampler()
    assert sampler.auto is not None and sampler.cost_for(0) == auto_cost_prior(None)
    plans, _ = _run(sampler, 12)
    fitted = sampler.auto.model
    assert isinstance(fitted, FittedCost) and fitted.c == pytest.approx(TRUTH["c"], rel=0.2)
    assert sampler.cost_for(12) == fitted
    prior_plans = [_auto_sampler().minibatch(s).microbatches for s in range(12)]
    assert plans[0] == prior_plans[0] and plans != prior_plans  # the fit changed later plans


def test_resume_plans_exactly_like_an_uninterrupted_run():
    """Save after 7 steps (JSON), restore into a fresh sampler, continue: the plans of the next 8 steps equal those
    of the run that never stopped, because the fit's statistics travel in the state_dict."""
    full, saved = _run(_auto_sampler(), 15, state_at=7)
    assert saved["auto_cost"]["observed"] == 7 and saved["step"] == 7
    resumed = _auto_sampler()
    resumed.load_state_dict(saved)
    rest, _ = _run(resumed, 8)
    assert rest == full[7:]
    cold = _auto_sampler()  # the same steps without the fit's state: planned from the prior again, differently
    cold.load_state_dict({k: v for k, v in saved.items() if k != "auto_cost"})
    assert _run(cold, 8)[0] != full[7:]


def test_lag_uses_older_fits():
    lagged = _auto_sampler(cost_lag=2)
    _run(lagged, 10)
    assert lagged.cost_for(10) == lagged.auto.model_for(10) != lagged.auto.model  # the fit after 8 observations
    with pytest.raises(ValueError, match="settings"):
        _auto_sampler(cost_lag=0).load_state_dict(lagged.state_dict())


def test_c_is_reported_as_measured_only_when_counts_differ():
    rng = np.random.default_rng(12)
    equal, mixed = AutoCost(PRIOR), AutoCost(PRIOR)
    for _ in range(6):
        T, S, M, busy = map(list, zip(*(rank_step(rng) for _ in range(4))))
        mixed_update = mixed.observe(T, S, M, busy)
        equal_update = equal.observe(T, S, [3] * 4, busy)
    assert mixed_update.c_measured and not equal_update.c_measured


def test_a_sampler_that_is_never_observed_says_so(caplog):
    sampler = _auto_sampler()
    with caplog.at_level("WARNING", logger="ds_odc.balancer"):
        plans = [b.microbatches for _, b in zip(range(4), sampler)]
    assert len(plans) == 4 and "call sampler.observe" in caplog.text
