"""Reading ahead (`ExpertOffload.prefetch`): the experts a plan expects are read before the pass
reaches their layer, count as that pass's reads, change no output, and a failed or abandoned read
leaves no slot claiming weights it does not hold."""

from __future__ import annotations

import pytest
import torch

from moe_spec import LookupDrafter, SpecDecoder
from moe_spec.core.target import TargetModel
from moe_spec.offload.expert_store import StoreError
from moe_spec.testing.helpers import PLAIN_PROMPT, REPETITIVE_PROMPT, hf_greedy

from offload_helpers import NUM_EXPERTS, assert_same_logits, assert_slots_hold_their_experts, model_of, routed_experts
from test_offload_failure import Truncated

IDS = torch.tensor([REPETITIVE_PROMPT])


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_experts_read_ahead_are_resident_when_the_pass_needs_them(make_offloaded, arch):
    model, offload = make_offloaded(arch, resident=6, prefetch=True)
    reference = model_of(arch)
    needed = routed_experts(reference, IDS)  # [L] what the pass will route to
    started = offload.prefetch(needed)
    assert started == sum(min(len(layer), 6 // 2) for layer in needed)
    before = offload.counters.copy()
    with torch.no_grad():
        got = model(input_ids=IDS).logits
    done = offload.counters.since(before)
    assert_same_logits(got, reference(input_ids=IDS).logits, arch)
    assert done.misses == sum(len(layer) for layer in needed), "read ahead or on demand, every read is counted once"
    assert done.read_ahead == started and done.read_ahead_used == started
    assert done.hits == 0, "nothing was resident before the step"
    assert_slots_hold_their_experts(offload, reference)


def test_prefetch_is_off_by_default_and_without_a_cache(make_offloaded):
    for config in ({"resident": 0, "prefetch": True}, {"resident": 6, "cache": "whole-layer", "prefetch": True},
                   {"resident": 6}):
        _, offload = make_offloaded("qwen3_moe", **config)
        assert offload.prefetch([[0, 1, 2]] * len(offload.caches)) == 0, config


def test_prefetched_experts_never_take_more_than_half_the_slots_and_ids_repeat_harmlessly(make_offloaded):
    _, offload = make_offloaded("qwen3_moe", resident=4, prefetch=True)
    assert offload.prefetch([[0, 0, 1, 2, 3, 4]] * len(offload.caches)) == 2 * len(offload.caches)
    offload.clear()  # lands the reads in flight before the cold cache hands their slots out
    assert not any(cache.resident.any() for cache in offload.caches)


def test_a_failed_read_ahead_raises_in_the_pass_and_leaves_the_cache_consistent(make_offloaded):
    model, offload = make_offloaded("qwen3_moe", resident=6, prefetch=True)
    reference = model_of("qwen3_moe")
    layout = offload.store.layout
    with Truncated(offload, layout.offset(1, 0)):  # layer 1's experts are unreadable
        offload.prefetch([list(range(NUM_EXPERTS))] * len(offload.caches))
        with pytest.raises(StoreError), torch.no_grad():
            model(input_ids=IDS)
    assert_slots_hold_their_experts(offload, reference)
    with torch.no_grad():
        assert_same_logits(model(input_ids=IDS).logits, reference(input_ids=IDS).logits, "qwen3_moe")


def test_decoding_with_predicted_experts_read_ahead_stays_greedy_and_reads_ahead(make_offloaded):
    from tests.offload.test_offload_lossless import reference_profile
    from moe_spec.policy.registry import MethodContext, build_method

    model, offload = make_offloaded("mixtral", resident=3, prefetch=True)
    target = TargetModel(model, offload=offload)
    method = build_method("moe-aware", MethodContext(target, LookupDrafter, lambda: reference_profile("mixtral")))
    calls = []
    original = offload.prefetch
    offload.prefetch = lambda experts: calls.append(original(experts)) or calls[-1]
    decoder = SpecDecoder(target, drafter=method.drafter, controller=method.controller)
    for prompt in (REPETITIVE_PROMPT, PLAIN_PROMPT):
        result = decoder.generate(torch.tensor([prompt]), max_new_tokens=20)
        assert torch.equal(result.sequences, hf_greedy(model_of("mixtral"), prompt, 20))
    assert calls and sum(calls) > 0, "the plan's predicted experts were read ahead"
