"""`ArmRates`: what it holds is checked, and it survives the profile's files."""

import pytest

from moe_spec.core.sampling import SamplingConfig
from moe_spec.profile.arm_rates import ArmRates


def test_arm_rates_round_trip_their_dict():
    entry = ArmRates(SamplingConfig(temperature=0.7, top_p=0.9), 1, {"sized": 0.12, "static:4": 0.11}, {"sized": 30, "static:4": 28})
    assert ArmRates.from_dict(entry.to_dict()) == entry
    offloaded = ArmRates(SamplingConfig(), 4, {"plain": 0.1}, {"plain": 5}, resident_experts=16)
    assert ArmRates.from_dict(offloaded.to_dict()) == offloaded
    assert ArmRates.from_dict({k: v for k, v in entry.to_dict().items() if k != "resident_experts"}) == entry
    with_tokens = ArmRates(SamplingConfig(), 1, {"plain": 0.1, "static:2": 0.12}, {"plain": 5, "static:2": 4},
                           tokens={"plain": 1.0, "static:2": 1.8})
    assert ArmRates.from_dict(with_tokens.to_dict()) == with_tokens
    assert ArmRates.from_dict({k: v for k, v in with_tokens.to_dict().items() if k != "tokens"}).tokens == {}, \
        "a profile made before tokens were kept loads without them"


@pytest.mark.parametrize("rates, steps, match", [
    ({"sized": 0.0}, {"sized": 3}, "positive and finite"),
    ({"sized": float("nan")}, {"sized": 3}, "positive and finite"),
    ({"sized": 0.1}, {}, "number of steps"),
    ({"sized": 0.1}, {"sized": 0}, "number of steps"),
])
def test_bad_arm_rates_are_refused(rates, steps, match):
    with pytest.raises(ValueError, match=match):
        ArmRates(SamplingConfig(), 1, rates, steps)


@pytest.mark.parametrize("tokens", [{"sized": 2.0}, {"sized": 2.0, "plain": 0.5}, {"sized": float("inf"), "plain": 1.0}])
def test_bad_arm_tokens_are_refused(tokens):
    with pytest.raises(ValueError, match="arm tokens"):
        ArmRates(SamplingConfig(), 1, {"sized": 0.1, "plain": 0.1}, {"sized": 3, "plain": 3}, tokens=tokens)
