"""The sizing learns what reads cost an offloaded run apart from the machine's speed
(`CostCorrection.fetch_scale`) and prices its misses at it; `moe-aware-profilefetch` keeps the
profile's price. Both stay greedy-identical (every registry method is also in the lossless suite)."""

from __future__ import annotations

import pytest
import torch

from moe_spec import LookupDrafter, SpecDecoder
from moe_spec.core.target import TargetModel
from moe_spec.policy.registry import MethodContext, build_method
from moe_spec.testing.helpers import PLAIN_PROMPT, REPETITIVE_PROMPT, hf_greedy

from offload_helpers import model_of
from test_offload_lossless import reference_profile


def _decode(make_offloaded, method: str):
    model, offload = make_offloaded("mixtral", resident=3)
    target = TargetModel(model, offload=offload)
    built = build_method(method, MethodContext(target, LookupDrafter, lambda: reference_profile("mixtral")))
    decoder = SpecDecoder(target, drafter=built.drafter, controller=built.controller)
    for prompt in (REPETITIVE_PROMPT, PLAIN_PROMPT + REPETITIVE_PROMPT):
        result = decoder.generate(torch.tensor([prompt]), max_new_tokens=24)
        assert torch.equal(result.sequences, hf_greedy(model_of("mixtral"), prompt, 24)), method
    return getattr(built.controller, "sizing", built.controller)


def test_the_sizing_learns_the_price_of_reads_and_prices_misses_at_it(make_offloaded):
    sizing = _decode(make_offloaded, "moe-aware-unbounded")
    correction = sizing.cost_correction
    assert correction.fetch_scale != 1.0, "passes that read told the price of reads"
    assert correction.low <= correction.fetch_scale <= correction.high
    profiled = sizing.profile.cost_model.fetch
    priced = sizing.cost_model().fetch
    assert priced.scale == pytest.approx(profiled.scale * correction.fetch_scale)
    assert priced.overflow_ms == pytest.approx(profiled.overflow_ms * correction.fetch_scale)


def test_the_ablation_prices_reads_at_the_profiles_fetch_cost(make_offloaded):
    sizing = _decode(make_offloaded, "moe-aware-profilefetch")
    assert not sizing.settings.learn_fetch
    assert sizing.cost_correction.fetch_scale == 1.0
    assert sizing.cost_model().fetch is sizing.profile.cost_model.fetch
