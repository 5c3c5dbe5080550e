"""The bound shared by the equality tests (tests/_support/tolerance.py): its arithmetic, and the cases it must fail."""

import math

import pytest

from _support.tolerance import (FACTOR, FP32_EPS, SCALAR_ULPS, assert_caught, assert_within, compare, compare_logs,
                                logged_distance)


@pytest.fixture(autouse=True)
def _not_logged(monkeypatch):
    monkeypatch.delenv("ODC_TOLERANCE_LOG", raising=False)  # these made-up numbers are no run's distances


def test_the_bound_is_a_multiple_of_the_reference_plus_a_floor():
    c = compare("x", measured=3e-7, reference=1e-7)
    assert c.bound == pytest.approx(FACTOR * 1e-7 + FP32_EPS) and c.holds
    assert compare("x", 1e-6, 1e-7).holds is False
    assert compare("x", 2 * FP32_EPS, 0.0, ulps=SCALAR_ULPS).holds  # a reference that happened to round exactly
    message = str(compare("params", 1e-6, 1e-7))
    assert "measured 1e-06" in message and "reference 1e-07" in message and "bound 5.192e-07" in message


def test_a_reference_above_rounding_or_not_a_number_fails():
    far = compare("x", 0.0, 1e-3)  # the float64 run computed something else: the bound would be loose
    assert not far.holds and "not the same computation" in str(far)
    assert not compare("x", math.nan, 1e-7).holds and not compare("x", 0.0, math.nan).holds
    with pytest.raises(AssertionError, match="measured 1e-06, reference 1e-07"):
        assert_within(compare("ok", 0.0, 1e-7), compare("params", 1e-6, 1e-7))


def test_a_planted_error_must_land_well_outside_the_bound():
    assert_caught(compare("planted", 1e-2, 1e-7))
    with pytest.raises(AssertionError, match="would not catch it"):
        assert_caught(compare("planted", 1e-6, 1e-7))  # outside, but by less than 10x


def test_logged_values_share_the_largest_reference():
    stock = [{"loss": 1.0, "norm": 2.0}, {"loss": 0.5, "norm": 2.0, "reward": 0.25}]
    fp64 = [{"loss": 1.0 + 1e-7, "norm": 2.0}, {"loss": 0.5, "norm": 2.0, "reward": 0.25}]
    odc = [{"loss": 1.0, "norm": 2.0 * (1 + 3e-7)}, {"loss": 0.5, "norm": 2.0, "reward": 0.25}]
    comparisons = {c.what: c for c in compare_logs("odc", odc, stock, fp64)}
    assert all(c.reference == pytest.approx(1e-7) for c in comparisons.values())
    assert comparisons["odc: logged 'norm'"].measured == pytest.approx(3e-7)
    assert_within(*comparisons.values())
    assert logged_distance([{"loss": 1.0}], [{"loss": 1.0, "kl": 0.0}], "kl") == math.inf  # logged by one side only
    assert logged_distance([{"kl": 1e-9}], [{"kl": 0.0}], "kl", scale=1e-6) == pytest.approx(1e-3)
