"""The fetch stage's refit of the fixed cost and the overflow price: least squares in relative error,
both kept >= 0."""

import numpy as np
import pytest

from moe_spec.measure.fetch_profile import _fit_base_and_slope


def test_the_refit_recovers_a_base_and_an_overflow_price_from_exact_passes():
    rng = np.random.default_rng(0)
    beyond = rng.integers(0, 40, size=60).astype(float)  # experts beyond the slots, summed over layers
    others = rng.uniform(8.0, 30.0, size=60)  # what the other terms explain
    ms = others + 3.0 + 0.45 * beyond
    assert _fit_base_and_slope(ms - others, beyond, ms) == pytest.approx((3.0, 0.45))


def test_a_negative_term_is_held_at_zero_and_the_other_refitted_alone():
    beyond = np.array([0.0, 0.0, 10.0, 20.0, 30.0])
    ms = np.array([10.0, 10.0, 12.0, 14.0, 16.0])
    base, per = _fit_base_and_slope(np.array([4.0, 4.0, 3.0, 2.0, 1.0]), beyond, ms)  # falls with the overflow
    assert per == 0.0 and base == pytest.approx(np.sum(np.array([4, 4, 3, 2, 1]) / ms**2) / np.sum(1 / ms**2))
    base, per = _fit_base_and_slope(np.array([-1.0, -1.0, 1.0, 3.0, 5.0]), beyond, ms)
    assert base == 0.0 and per > 0
    assert _fit_base_and_slope(np.array([2.0, 2.0]), np.zeros(2), np.array([10.0, 10.0])) == pytest.approx((2.0, 0.0))
