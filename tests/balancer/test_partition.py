import itertools

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ds_odc.balancer import greedy_lpt, makespan, partition

costs_st = st.lists(st.integers(min_value=0, max_value=1000), min_size=0, max_size=40)


def _check_cover(parts, n, k):
    assert len(parts) == k
    flat = sorted(i for p in parts for i in p)
    assert flat == list(range(n)), "an item was lost or duplicated"


@settings(max_examples=150, deadline=None)
@given(costs=costs_st, k=st.integers(min_value=1, max_value=9))
def test_free_mode_covers_items_and_fills_bins(costs, k):
    parts = partition(costs, k)
    _check_cover(parts, len(costs), k)
    if len(costs) >= k:
        assert all(parts), "a bin is empty although there are at least k items"
    assert makespan(costs, parts) <= makespan(costs, greedy_lpt(costs, k)) + 1e-9


@settings(max_examples=150, deadline=None)
@given(costs=costs_st, k=st.integers(min_value=1, max_value=9))
def test_equal_mode_covers_items_with_equal_sizes(costs, k):
    parts = partition(costs, k, equal_size=True)
    _check_cover(parts, len(costs), k)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1


def _brute_force(c, k, equal):
    A = np.array(list(itertools.product(range(k), repeat=len(c))))
    if equal:
        cnt = np.stack([(A == b).sum(1) for b in range(k)], 1)
        A = A[(cnt.max(1) - cnt.min(1)) <= 1]
    sums = np.stack([(A == b) @ np.asarray(c, dtype=float) for b in range(k)], 1)
    return sums.max(1).min()


@pytest.mark.parametrize("equal", [False, True])
def test_small_instances_against_brute_force(equal):
    """Stated bound: never above 4/3 of the optimum (free mode inherits LPT's 4/3 - 1/(3k) through the portfolio
    start; equal mode is checked empirically), and optimal on at least 90% of these random instances.
    Measured: free 96%, equal 98% optimal; worst ratio 1.019 / 1.014."""
    ratios = []
    for seed in range(200):
        rng = np.random.default_rng(seed)
        k = int(rng.integers(2, 4))
        n = int(rng.integers(k, 9 if k == 2 else 8))
        c = rng.integers(1, 100, n).tolist()
        opt = _brute_force(c, k, equal)
        got = makespan(c, partition(c, k, equal_size=equal))
        assert got >= opt - 1e-9
        assert got <= (4 / 3 - 1 / (3 * k)) * opt + 1e-9
        ratios.append(got / opt)
    r = np.asarray(ratios)
    assert (r <= 1 + 1e-12).mean() >= 0.90
    assert r.max() < 1.05


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), dist=st.sampled_from(["lognormal", "uniform", "pareto"]))
def test_at_least_as_good_as_lpt_on_large_random_instances(seed, dist):
    rng = np.random.default_rng(seed)
    k = int(rng.integers(2, 65))
    n = int(rng.integers(2 * k, 20 * k + 1))
    c = {
        "lognormal": lambda: np.exp(rng.normal(0, 1, n)) * 1000,
        "uniform": lambda: rng.integers(1, 1000, n).astype(float),
        "pareto": lambda: (rng.pareto(1.5, n) + 1) * 100,
    }[dist]().round().tolist()
    kk = makespan(c, partition(c, k))
    lpt = makespan(c, greedy_lpt(c, k))
    assert kk <= lpt + 1e-9


def test_large_instance_is_near_perfect():
    """4,096 long-sft-like items on 512 bins: within 0.1% of the mean (LPT is ~3.7% above it)."""
    from ds_odc.balancer.presets import get_preset

    c = get_preset("long-sft").sample(4096, seed=0).astype(float).tolist()
    mean = sum(c) / 512
    got = makespan(c, partition(c, 512))
    assert got / mean - 1 < 1e-3
    assert makespan(c, greedy_lpt(c, 512)) / mean - 1 > 0.03
    eq = partition(c, 512, equal_size=True)
    assert {len(p) for p in eq} == {8}
    assert makespan(c, eq) / mean - 1 < 2e-3


def test_deterministic_and_classic_examples():
    c = [8, 7, 6, 5, 4]
    assert partition(c, 2) == partition(list(c), 2)
    assert makespan(c, partition(c, 2)) == 15  # {8,7} {6,5,4}
    assert makespan([4, 5, 6, 7, 8], partition([4, 5, 6, 7, 8], 2, equal_size=True)) == 15  # {7,8} {4,5,6}
    big = partition([100, 1, 1, 1], 2)
    assert sorted(map(len, big)) == [1, 3]
    assert partition([], 3) == [[], [], []]
    assert sorted(map(len, partition([5, 5], 4))) == [0, 0, 1, 1]


def test_rejects_bad_input():
    with pytest.raises(ValueError):
        partition([1, -1], 2)
    with pytest.raises(ValueError):
        partition([1, float("nan")], 2)
    with pytest.raises(ValueError):
        partition([1, 2], 0)
