"""`MoeAwareController`'s collaborators, each alone: its settings, the speculation gate and the
profile's cached prices (on the shipped profile of the embedded pair, a real one)."""

import pytest

from moe_spec.measure.store import DEFAULT_PROFILE
from moe_spec.policy.moe_aware import MoeAwareSettings
from moe_spec.policy.profile_prices import ProfilePrices
from moe_spec.policy.speculation_gate import SpeculationGate
from moe_spec.profile.artifact import Profile


def test_settings_refuse_values_that_cannot_size_a_tree():
    assert MoeAwareSettings().gate and MoeAwareSettings(gate=False).price_experts
    for name, value in (("candidate_min", 0), ("recent_steps", 0), ("probe_every", 0), ("sampled_min", 0)):
        with pytest.raises(ValueError, match=name):
            MoeAwareSettings(**{name: value})
    with pytest.raises(ValueError, match="candidate_growth"):
        MoeAwareSettings(candidate_growth=0.0)


def _lose(gate: SpeculationGate, steps: int, rows: int = 1) -> None:
    for _ in range(steps):  # 1 token in 10 ms against plain decoding's 1 in 5
        gate.observe(rows, True, 1.0, 10.0)


def test_the_gate_pauses_where_speculation_measures_below_plain_and_probes_every_nth_step():
    gate = SpeculationGate(probe_every=3)
    plain = lambda: 1 / 5.0  # noqa: E731
    assert not gate.pauses(plain, modelled_plain=True), "nothing measured yet: no pause"
    _lose(gate, gate.rates.min_speculative_steps)
    decisions = [gate.pauses(plain, modelled_plain=False) for _ in range(6)]
    assert decisions == [True, True, False, True, True, False]
    gate.drafted()
    assert gate.paused_steps == 0


def test_the_gate_forgets_a_batch_size_it_no_longer_decodes_and_a_replay_follows_the_model():
    gate = SpeculationGate()
    _lose(gate, 8, rows=4)
    assert gate.pauses(lambda: 1 / 5.0, modelled_plain=False)
    gate.observe(3, True, 3.0, 10.0)  # a row left: what 4 rows measured says nothing of 3
    assert len(gate.rates.recent) == 1 and not gate.pauses(lambda: 1 / 5.0, modelled_plain=False)
    replay = SpeculationGate(probe_every=2)
    assert replay.pauses(None, modelled_plain=True) and not replay.pauses(None, modelled_plain=True)
    assert not replay.pauses(None, modelled_plain=False)


@pytest.fixture(scope="module")
def profile():
    return Profile.load(DEFAULT_PROFILE)


def test_profile_prices_are_the_cost_models_own(profile):
    prices, cost = ProfilePrices(profile), profile.cost_model
    top_k, layers = profile.top_k, cost.num_layers
    assert prices.plain_pass_ms(1) == pytest.approx(cost.predict_ms(1, [float(top_k)] * layers))
    assert prices.plain_pass_ms(4) > prices.plain_pass_ms(1)
    # a chain of L nodes loads the unique-experts curve at L + 1 tokens
    assert prices.chain_verify_ms(3, 1) == pytest.approx(cost.predict_ms(4, prices.curve_at(4)))
    tokens_only = ProfilePrices(profile, price_experts=False)
    assert tokens_only.chain_verify_ms(3, 2) == pytest.approx(cost.fixed_ms(2) + cost.per_token_ms * 8)
    # the expected experts folded into the token price: the whole tree of n nodes and its root cost
    # the cost model at U(n + 1)
    folded = prices.with_expected_experts(cost, 5)
    whole = folded.fixed_ms(1) + folded.per_token_ms * 6
    assert whole == pytest.approx(cost.predict_ms(6, prices.curve_at(6)))
