"""Reading a layer ahead (`OffloadConfig(layer_ahead=True)`): while a MoE layer computes, the experts
the next layer's router picks for this layer's hidden states are read; they count as the next
layer's reads, change no output, never take more than half its slots, and a failed read leaves no
slot claiming weights it does not hold."""

from __future__ import annotations

import pytest
import torch

from moe_spec.errors import InputError
from moe_spec.offload.expert_store import StoreError
from moe_spec.offload.offloaded_experts import _next_routers
from moe_spec.testing.helpers import PLAIN_PROMPT, REPETITIVE_PROMPT
from moe_spec.testing.tiny_models import MOE_ARCHITECTURES

from offload_helpers import assert_same_logits, assert_slots_hold_their_experts, model_of
from test_offload_failure import Truncated

IDS = torch.tensor([REPETITIVE_PROMPT])
ONE_TOKEN = torch.tensor([PLAIN_PROMPT[:1]])


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_every_architecture_reads_the_next_layer_ahead_and_its_logits_are_unchanged(make_offloaded, arch):
    model, offload = make_offloaded(arch, resident=4, layer_ahead=True)
    reference = model_of(arch)
    with torch.no_grad():
        got = model(input_ids=ONE_TOKEN).logits
        want = reference(input_ids=ONE_TOKEN).logits
    assert_same_logits(got, want, arch, streamed=False)
    assert offload.counters.read_ahead > 0, "the second MoE layer's picks were read while the first computed"
    assert offload.counters.read_ahead_used <= offload.counters.read_ahead
    assert_slots_hold_their_experts(offload, reference)


def test_reads_ahead_count_once_take_at_most_half_the_slots(make_offloaded):
    model, offload = make_offloaded("qwen3_moe", resident=4, layer_ahead=True)
    with torch.no_grad():
        model(input_ids=ONE_TOKEN)
    done = offload.counters
    assert 0 < done.read_ahead <= 4 // 2, "one MoE layer after the first, at most half of its 4 slots"
    assert done.per_layer_misses[1] >= done.read_ahead, "what was read ahead counts as the next layer's reads"
    assert done.per_layer_misses[0] == 2, "the first layer reads its own top-2 on demand"
    assert done.misses == done.per_layer_misses[0] + done.per_layer_misses[1]


def test_nothing_is_read_ahead_without_a_cache_or_with_whole_layer_reads(make_offloaded):
    for config in ({"resident": 0}, {"cache": "whole-layer"}, {"resident": 4, "layer_ahead": False}):
        model, offload = make_offloaded("qwen3_moe", layer_ahead=config.pop("layer_ahead", True), **config)
        with torch.no_grad():
            model(input_ids=IDS)
        assert offload.counters.read_ahead == 0, config


def test_a_failed_read_ahead_raises_in_the_pass_and_leaves_the_cache_consistent(make_offloaded):
    model, offload = make_offloaded("qwen3_moe", resident=6, layer_ahead=True)
    reference = model_of("qwen3_moe")
    layout = offload.store.layout
    with Truncated(offload, layout.offset(1, 0)):  # the second MoE layer's experts are unreadable
        with pytest.raises(StoreError), torch.no_grad():
            model(input_ids=IDS)
    assert_slots_hold_their_experts(offload, reference)
    with torch.no_grad():
        assert_same_logits(model(input_ids=IDS).logits, reference(input_ids=IDS).logits, "qwen3_moe")
    assert_slots_hold_their_experts(offload, reference)


def test_a_model_without_a_router_for_every_moe_layer_is_refused_by_name():
    model = model_of("qwen3_moe")
    with pytest.raises(InputError, match="layer_ahead needs the router of every MoE layer.*\\[99\\]"):
        _next_routers(model, (0, 99))
    assert _next_routers(model, (0, 99), required=False) == [], "not reading ahead: nothing to refuse"


def test_a_config_that_turns_reading_ahead_on_later_reads_ahead(make_offloaded):
    from dataclasses import replace

    model, offload = make_offloaded("qwen3_moe", resident=4)
    with torch.no_grad():
        model(input_ids=ONE_TOKEN)
    assert offload.counters.read_ahead == 0
    offload.clear()
    offload.config = replace(offload.config, layer_ahead=True)
    with torch.no_grad():
        model(input_ids=ONE_TOKEN)
    assert offload.counters.read_ahead > 0


def test_a_profile_fitted_on_passes_read_the_other_way_is_named():
    from dataclasses import replace

    from moe_spec.policy.registry import reading_mismatch
    from tests.offload.test_offload_lossless import reference_profile

    profile = reference_profile("qwen3_moe")
    on_demand = replace(profile, details={**profile.details, "fetch_cost_report": {"reading": "on demand"}})
    ahead = replace(profile, details={**profile.details, "fetch_cost_report": {"reading": "a layer ahead"}})
    older = replace(profile, details={**profile.details, "fetch_cost_report": {"passes": 10}})
    assert reading_mismatch(on_demand, layer_ahead=False) is None
    assert reading_mismatch(ahead, layer_ahead=True) is None
    assert "profile_fetch.py --layer-ahead" in reading_mismatch(on_demand, layer_ahead=True)
    assert "read their experts on demand" in reading_mismatch(older, layer_ahead=True), "a report from before: on demand"
    assert "read their experts a layer ahead" in reading_mismatch(ahead, layer_ahead=False)
    assert reading_mismatch(replace(profile, details={}), layer_ahead=True) is None, "fetch cost measured now: no report"
