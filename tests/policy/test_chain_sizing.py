"""Sampled chains sized from measured per-depth acceptance (`policy/chain_sizing.py`)."""

import itertools

import pytest

from moe_spec.policy.chain_sizing import ChainAcceptance, best_chain_length


def test_the_prior_moves_towards_what_chains_accept():
    chain = ChainAcceptance((0.8, 0.6), prior_steps=4.0)
    assert chain.conditional(1) == pytest.approx(0.8) and chain.conditional(2) == pytest.approx(0.6)
    assert chain.conditional(5) == pytest.approx(0.6), "deeper than profiled: its deepest figure"
    chain.observe([(1, 0.2)] * 4 + [(2, 1.0)] * 12)
    assert chain.conditional(1) == pytest.approx((4 * 0.8 + 0.8) / 8)
    assert chain.conditional(2) == pytest.approx((4 * 0.6 + 12) / 16)
    assert chain.reach(3) == pytest.approx([chain.conditional(1), chain.conditional(1) * chain.conditional(2),
                                            chain.conditional(1) * chain.conditional(2) * chain.conditional(3)])


@pytest.mark.parametrize("prior", [(), (0.5, 1.2), (-0.1,)])
def test_a_prior_that_is_not_per_depth_probabilities_is_refused(prior):
    with pytest.raises(ValueError, match="chain prior"):
        ChainAcceptance(prior)


def test_the_best_length_is_the_argmax_of_tokens_per_ms_plain_included():
    for reach, fixed, per_node in itertools.product(([0.9, 0.8, 0.7, 0.2], [0.3, 0.1], [0.99] * 6), (0.0, 5.0),
                                                    (0.5, 4.0, 40.0)):
        def step_ms(length):
            return 20.0 + (fixed + per_node * length if length else 0.0)

        rates = [(1 + sum(reach[:n])) / step_ms(n) for n in range(len(reach) + 1)]
        length, rate = best_chain_length(reach, step_ms)
        assert length == max(range(len(rates)), key=rates.__getitem__)
        assert rate == pytest.approx(max(rates))
    assert best_chain_length([0.01, 0.01], lambda n: 20.0 + 10.0 * n)[0] == 0, "nothing pays: a plain step"
    rows = best_chain_length([0.9, 0.5], lambda n: 20.0 + 3.0 * n, rows=4)
    assert rows[1] == pytest.approx(4 * (1 + 0.9 + 0.5) / 26.0), "every row's tokens"
