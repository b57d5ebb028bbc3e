"""The profile's arm stage on a real tiny pair: every arm allowed for each setting is measured,
decoding stays the target's own, and a profile holding the rates gives moe-aware's bandit its prior
(resident experts only)."""

import dataclasses
import warnings

import pytest
import torch

from moe_spec import SpecDecoder
from moe_spec.core.sampling import GREEDY, SamplingConfig
from moe_spec.core.target import TargetModel
from moe_spec.drafters.eagle import EagleDrafter
from moe_spec.measure.arm_rates_stage import arm_rates_stage
from moe_spec.measure.latency import TimingConfig
from moe_spec.measure.profiler import ProfileSettings, build_profile
from moe_spec.policy.bounded_controller import PLAIN, SIZED, BoundedController, measured_priors
from moe_spec.policy.budget_bandit import RegimeKey
from moe_spec.policy.moe_aware import MoeAwareController
from moe_spec.policy.registry import build_controller
from moe_spec.testing.helpers import PLAIN_PROMPT, REPETITIVE_PROMPT, hf_greedy, random_eagle_head
from moe_spec.testing.tiny_models import tiny_model

QUICK = ProfileSettings(max_new_tokens=12, prefix_len=16, grid_tokens=(1, 4, 16), grid_experts=(2, 4, 8),
                        natural_trees=4, curve_sizes=(1, 2, 4), batch_sizes=(),
                        timing=TimingConfig(repeats=1, warmup=0, evict_mb=0))
PROMPTS = [torch.tensor(p) for p in (REPETITIVE_PROMPT, PLAIN_PROMPT)]


@pytest.fixture(scope="module")
def measured():
    model = tiny_model("qwen3_moe")
    target = TargetModel(model)
    drafter = EagleDrafter(random_eagle_head(target, 64), target)
    profile = build_profile(target, drafter, PROMPTS, QUICK)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no sampling setting profiled: top tokens, and a warning says so
        entries = arm_rates_stage(target, drafter, profile, PROMPTS, [GREEDY, SamplingConfig(temperature=1.0)], 24)
    return model, target, drafter, dataclasses.replace(profile, arm_rates=entries)


def test_every_allowed_arm_is_measured_per_setting(measured):
    _, _, _, profile = measured
    greedy, sampled = profile.arm_rates
    assert (greedy.sampling, sampled.sampling.temperature, greedy.rows) == (GREEDY, 1.0, 1)
    expected = {SIZED, PLAIN, "static:4", "static:2", "static:1", "static:6", "static:3"}
    assert set(greedy.rates) == expected and all(rate > 0 for rate in greedy.rates.values())
    assert all(steps >= 1 for steps in greedy.steps.values())
    # the tokens a row made a step: plain decoding one exactly; a tree at least one, a larger one no fewer
    assert set(greedy.tokens) == expected and greedy.tokens[PLAIN] == 1.0
    assert all(made >= 1 for made in greedy.tokens.values()) and greedy.tokens["static:6"] >= greedy.tokens["static:1"]


def test_a_profile_with_arm_rates_gives_the_bandit_its_prior_and_stays_lossless(measured, tmp_path):
    model, target, drafter, profile = measured
    profile.save(tmp_path / "p.json")
    from moe_spec.profile.artifact import Profile
    loaded = Profile.load(tmp_path / "p.json", target)
    assert loaded.arm_rates == profile.arm_rates
    controller = build_controller("moe-aware", lambda: loaded)
    assert controller.bandit.priors[RegimeKey.of(GREEDY, 1)] == profile.arm_rates[0].rates
    for prompt in (REPETITIVE_PROMPT, PLAIN_PROMPT):
        result = SpecDecoder(target, drafter, controller).generate(torch.tensor([prompt]), max_new_tokens=20, eos_token_id=[])
        assert torch.equal(result.sequences, hf_greedy(model, prompt, 20))


def test_offloaded_experts_take_the_prior_measured_offloaded_and_resident_ones_the_resident(measured):
    _, _, _, profile = measured
    greedy = profile.arm_rates[0]
    offloaded_entry = dataclasses.replace(greedy, rates={SIZED: 1.0, PLAIN: 2.0}, steps={SIZED: 3, PLAIN: 3},
                                          resident_experts=16, tokens={SIZED: 2.5, PLAIN: 1.0})
    both = dataclasses.replace(profile, arm_rates=(greedy, offloaded_entry))
    resident = MoeAwareController(both, gate=False)
    offloaded = MoeAwareController(both, gate=False, residency=lambda: torch.ones(1, 1, dtype=torch.bool))
    assert measured_priors(resident) == {RegimeKey.of(GREEDY, 1): greedy.rates}
    assert BoundedController(offloaded).bandit.priors == {RegimeKey.of(GREEDY, 1): {SIZED: 1.0, PLAIN: 2.0}}
    assert BoundedController(offloaded, tilt=True).bandit.prior_tokens == {RegimeKey.of(GREEDY, 1): {SIZED: 2.5, PLAIN: 1.0}}
    assert BoundedController(offloaded).bandit.prior_tokens == {}, "the tilt is not the default"
    only_resident = MoeAwareController(profile, gate=False, residency=lambda: torch.ones(1, 1, dtype=torch.bool))
    assert measured_priors(only_resident) == {}


def test_batched_requests_are_measured_and_keyed_by_their_rows(measured):
    _, target, drafter, profile = measured
    [entry] = arm_rates_stage(target, drafter, profile, PROMPTS[:1], [GREEDY], 24, rows=2)  # the prompt twice
    assert entry.rows == 2 and SIZED in entry.rates and "static:4" in entry.rates
    assert entry.tokens[PLAIN] == 1.0, "tokens a row made a step, not the batch's"
    controller = build_controller("moe-aware", lambda: dataclasses.replace(profile, arm_rates=(entry,)))
    assert set(controller.bandit.priors) == {RegimeKey.of(GREEDY, 2)}


def test_too_few_new_tokens_to_settle_or_no_rows_are_refused(measured):
    _, target, drafter, profile = measured
    with pytest.raises(ValueError, match="max_new_tokens"):
        arm_rates_stage(target, drafter, profile, PROMPTS, [GREEDY], 3)
    with pytest.raises(ValueError, match="rows"):
        arm_rates_stage(target, drafter, profile, PROMPTS, [GREEDY], 8, rows=0)
