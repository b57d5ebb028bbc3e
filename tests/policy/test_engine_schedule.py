"""The speculation schedule for engines that verify chains (vLLM): K per batch size from the cost model,
and per-request chain lengths of most tokens per ms."""

import numpy as np
import pytest

from moe_spec.measure.store import DEFAULT_PROFILE
from moe_spec.policy.batch_chains import PassCost, batch_chain_lengths, share_from_union
from moe_spec.policy.engine_schedule import choose, schedule, step_ms, union_experts, vllm_ranges
from moe_spec.profile.artifact import Profile


@pytest.fixture(scope="module")
def profile():
    return Profile.load(DEFAULT_PROFILE)


def test_the_expert_union_grows_with_the_batch_and_saturates(profile):
    experts = profile.fingerprint["num_experts"]
    one, four, many = (union_experts(profile, rows, 4) for rows in (1, 4, 256))
    assert np.allclose(one, profile.unique_experts_curve.real_at(4))
    assert (four > one).all() and (many <= experts).all() and (many > 0.99 * experts).all()


def test_each_batch_size_takes_the_chain_length_of_most_tokens_per_ms(profile):
    reach = [0.7, 0.5, 0.35, 0.25, 0.18]
    for rows in (1, 3, 16):
        choice = choose(profile, reach, rows)
        rates = [rows * (1 + sum(reach[:k])) / step_ms(profile, rows, k) for k in range(6)]
        assert choice.length == int(np.argmax(rates)) and choice.rates == pytest.approx(rates)
        assert choice.rates[choice.length] >= choice.rates[0]  # never a predicted loss against not speculating


def test_speculation_that_never_pays_is_scheduled_off(profile):
    assert {c.length for c in schedule(profile, [0.01, 0.0001], 8)} == {0}


def test_vllm_ranges_merge_batch_sizes_of_one_length(profile):
    choices = schedule(profile, [0.7, 0.5, 0.35, 0.25, 0.18], 64)
    ranges = vllm_ranges(choices)
    assert ranges[0][0] == 1 and ranges[-1][1] == 64
    assert all(a[1] + 1 == b[0] and a[2] != b[2] for a, b in zip(ranges, ranges[1:]))
    for choice in choices:
        assert next(k for start, end, k in ranges if start <= choice.rows <= end) == choice.length


def _cost(per_token=0.2, per_expert=0.05, share=0.1):
    return PassCost(10.0, 0.0, per_token, np.full(4, per_expert), 64, np.full(4, share))


def test_batch_chains_take_the_most_likely_drafts_first():
    reach = [[0.9, 0.8, 0.7], [0.3, 0.1], [], [0.95]]
    lengths = batch_chain_lengths(reach, _cost())
    taken = sorted((r for chain, n in zip(reach, lengths) for r in chain[:n]), reverse=True)
    others = [r for chain, n in zip(reach, lengths) for r in chain[n:]]
    assert all(t >= o for t in taken for o in others) and lengths[2] == 0
    assert lengths[0] > 0 and lengths[3] == 1


def test_dear_experts_cut_the_drafts():
    reach = [[0.6, 0.4, 0.3, 0.2]] * 4
    cheap = sum(batch_chain_lengths(reach, _cost(per_token=0.01, per_expert=0.001)))
    dear = sum(batch_chain_lengths(reach, _cost(per_token=0.01, per_expert=2.0, share=0.02)))
    assert cheap == 16 and dear < cheap


def test_batch_chain_lengths_maximise_the_rate_over_every_count():
    rng = np.random.default_rng(0)
    reach = [sorted(rng.uniform(0, 1, rng.integers(0, 5)).tolist(), reverse=True) for _ in range(6)]
    cost = _cost(per_token=0.5, per_expert=0.3, share=0.05)
    lengths = batch_chain_lengths(reach, cost)
    flat = sorted((r for chain in reach for r in chain), reverse=True)
    rates = [(6 + sum(flat[:m])) / cost.ms(np.array(6 + m), 6) for m in range(len(flat) + 1)]
    chosen = sum(lengths)
    assert rates[chosen] == pytest.approx(max(rates))


def test_share_from_union_inverts_the_union():
    share = share_from_union(np.array([20.0, 40.0]), 10, 64)
    assert np.allclose(64 * (1 - (1 - share) ** 10), [20.0, 40.0])
