"""The arm stage on an offloaded target: measured offloaded, keyed by the cache size, every request
from a cold cache, and the bound built on that target takes those rates as its prior."""

import dataclasses

import torch

from moe_spec import LookupDrafter
from moe_spec.core.sampling import GREEDY
from moe_spec.core.target import TargetModel
from moe_spec.measure.arm_rates_stage import arm_rates_stage
from moe_spec.policy.bounded_controller import SIZED
from moe_spec.policy.budget_bandit import RegimeKey
from moe_spec.policy.registry import MethodContext, build_method
from moe_spec.testing.helpers import PLAIN_PROMPT, REPETITIVE_PROMPT

from test_offload_lossless import reference_profile


def test_offloaded_arms_are_measured_offloaded_and_become_the_offloaded_prior(make_offloaded):
    model, offload = make_offloaded("qwen3_moe", resident=3)
    target = TargetModel(model, offload=offload)
    profile = reference_profile("qwen3_moe")
    prompts = [torch.tensor(p) for p in (REPETITIVE_PROMPT, PLAIN_PROMPT)]
    [entry] = arm_rates_stage(target, LookupDrafter(), profile, prompts, [GREEDY], 32)
    assert entry.resident_experts == 3 and SIZED in entry.rates and all(r > 0 for r in entry.rates.values())
    measured = dataclasses.replace(profile, arm_rates=(entry,))
    bounded = build_method("moe-aware", MethodContext(target, LookupDrafter, lambda: measured)).controller
    assert bounded.bandit.priors == {RegimeKey.of(GREEDY, 1): entry.rates}
