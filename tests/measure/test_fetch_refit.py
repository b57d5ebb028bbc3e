"""The fetch stage's refit of the fixed cost, the fetch scale and the overflow price: least squares in
relative error, each kept >= 0."""

import numpy as np
import pytest

from moe_spec.measure.fetch_profile import _fit_nonnegative


def test_the_refit_recovers_a_base_a_read_scale_and_an_overflow_price_from_exact_passes():
    rng = np.random.default_rng(0)
    beyond = rng.integers(0, 40, size=60).astype(float)  # experts beyond the slots, summed over layers
    reads = rng.uniform(0.0, 15.0, size=60)  # sum_l m_l(M_l): the pass's reads timed alone
    others = rng.uniform(8.0, 30.0, size=60)  # what the compute terms explain
    ms = others + 3.0 + 0.6 * reads + 0.45 * beyond
    columns = np.stack([np.ones(60), reads, beyond], axis=1)
    assert _fit_nonnegative(ms - others, columns, ms) == pytest.approx([3.0, 0.6, 0.45])


def test_a_negative_term_is_held_at_zero_and_the_others_refitted_without_it():
    beyond = np.array([0.0, 0.0, 10.0, 20.0, 30.0])
    ms = np.array([10.0, 10.0, 12.0, 14.0, 16.0])
    columns = np.stack([np.ones(5), beyond], axis=1)
    falling = np.array([4.0, 4.0, 3.0, 2.0, 1.0])  # falls with the overflow: no price for it
    base, per = _fit_nonnegative(falling, columns, ms)
    assert per == 0.0 and base == pytest.approx(np.sum(falling / ms**2) / np.sum(1 / ms**2))
    base, per = _fit_nonnegative(np.array([-1.0, -1.0, 1.0, 3.0, 5.0]), columns, ms)
    assert base == 0.0 and per > 0
    assert _fit_nonnegative(np.array([2.0, 2.0]), np.stack([np.ones(2), np.zeros(2)], axis=1),
                            np.array([10.0, 10.0])) == pytest.approx([2.0, 0.0])
    assert _fit_nonnegative(np.array([-2.0, -3.0]), np.ones((2, 1)), np.array([10.0, 10.0])) == pytest.approx([0.0])
