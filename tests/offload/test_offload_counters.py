"""What an offloaded generation reports: hits and misses per verify pass (against a hand count from
the pass's own routing and the residency before it), bytes read, misses per generated token, the hit
rate, and the residency map."""

from __future__ import annotations

import math

import pytest
import torch

from moe_spec import LookupDrafter, SpecDecoder
from moe_spec.core.step_record import DecodeObserver
from moe_spec.testing.helpers import PLAIN_PROMPT, REPETITIVE_PROMPT
from moe_spec.testing.tiny_models import MOE_ARCHITECTURES, tiny_model

from offload_helpers import NUM_EXPERTS, TOP_K, assert_slots_hold_their_experts

LAYERS = 2


def experts_of(routing) -> list[set[int]]:
    """[L] the distinct experts each MoE layer of one pass routed to."""
    return [set(layer.reshape(-1).tolist()) for layer in routing.experts]


def resident_sets(offload) -> list[set[int]]:
    return [set(row.nonzero().flatten().tolist()) for row in offload.residency()]


class PassLog(DecodeObserver):
    """After each forward of a generation: the pass's routing, the residency and the counters."""

    def __init__(self, offload):
        self.offload = offload
        self.passes = []  # (needed per layer, resident per layer after, counters after, step record or None)

    def _log(self, record, step):
        self.passes.append((experts_of(record.routing), resident_sets(self.offload), self.offload.counters.copy(),
                            step))

    def on_prefill(self, record):
        self._log(record, None)

    def on_step(self, record):
        self._log(record, record)


def generate(make_offloaded, arch, prompts=(REPETITIVE_PROMPT,), new_tokens=12, **config):
    model, offload = make_offloaded(arch, **config)
    log = PassLog(offload)
    decoder = SpecDecoder(model, drafter=LookupDrafter(), offload=offload)
    decoder.observer = log
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    result = decoder.generate(ids, attention_mask=mask, max_new_tokens=new_tokens)
    return model, offload, log, result


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
@pytest.mark.parametrize("capacity", [TOP_K, 5, NUM_EXPERTS, 0])
def test_each_passes_hits_and_misses_match_its_routing_and_the_residency_before(make_offloaded, arch, capacity):
    model, offload, log, result = generate(make_offloaded, arch, resident=capacity)
    block = offload.store.layout.block_bytes
    assert offload.counters.calls == LAYERS * len(log.passes)
    before = [set() for _ in range(LAYERS)]
    seen = [set() for _ in range(LAYERS)]
    previous = None
    step_stats = iter(result.stats.steps)
    for needed, after, counters, record in log.passes:
        done = counters if previous is None else counters.since(previous)
        hits = [len(n & b) for n, b in zip(needed, before)]
        misses = [len(n) - h for n, h in zip(needed, hits)]
        assert (done.hits, done.misses, done.per_layer_misses) == (sum(hits), sum(misses), misses)
        assert done.bytes_read == sum(misses) * block
        if record is not None:  # the step's own counts, as the engine reports them
            stats = next(step_stats)
            assert (record.fetch.hits, record.fetch.misses, record.fetch.bytes_read) == \
                (sum(hits), sum(misses), sum(misses) * block)
            assert list(record.fetch.per_layer_misses) == misses
            assert (stats.expert_hits, stats.expert_misses, stats.bytes_read) == \
                (sum(hits), sum(misses), sum(misses) * block)
            assert stats.expert_hits + stats.expert_misses == sum(stats.unique_experts_per_layer)
            assert stats.fetch_wait_ms >= 0
        for layer in range(LAYERS):
            seen[layer] |= needed[layer]
            assert len(after[layer]) == min(capacity, len(seen[layer])), "min(C, experts seen) resident"
            if capacity == NUM_EXPERTS:
                assert after[layer] == seen[layer]
        before, previous = after, counters
    assert next(step_stats, None) is None
    assert offload.residency().shape == (LAYERS, NUM_EXPERTS) and offload.residency().dtype == torch.bool
    reference = tiny_model(arch)
    assert_slots_hold_their_experts(offload, reference)


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_misses_and_bytes_per_generated_token(make_offloaded, arch):
    _, offload, log, result = generate(make_offloaded, arch, prompts=(REPETITIVE_PROMPT, PLAIN_PROMPT[:5]),
                                       resident=3)
    stats = result.stats
    steps = stats.steps
    produced = sum(s.accepted_length for s in steps)
    assert produced == stats.new_tokens - 2, "every row's first token comes from the prefill"
    step_misses = sum(s.expert_misses for s in steps)
    prefill = log.passes[0][2]  # counters after the prefill: a cold cache reads every expert it routes to
    assert prefill.hits == 0 and prefill.misses == sum(len(n) for n in log.passes[0][0])
    assert offload.counters.misses == prefill.misses + step_misses
    assert offload.counters.bytes_read == offload.counters.misses * offload.store.layout.block_bytes
    assert stats.misses_per_token == pytest.approx(step_misses / produced)
    assert stats.bytes_read_per_token == pytest.approx(step_misses * offload.store.layout.block_bytes / produced)
    hits = sum(s.expert_hits for s in steps)
    assert stats.hit_rate == pytest.approx(hits / (hits + step_misses))
    assert 0 < stats.hit_rate < 1
    summary = stats.summary()
    assert summary["misses_per_token"] == round(stats.misses_per_token, 3)
    assert summary["hit_rate"] == round(stats.hit_rate, 4)


@pytest.mark.parametrize("arch", ["mixtral", "olmoe"])
def test_whole_layer_fetching_reads_every_expert_of_every_layer_each_pass(make_offloaded, arch):
    _, offload, log, result = generate(make_offloaded, arch, cache="whole-layer")
    block = offload.store.layout.block_bytes
    for stats in result.stats.steps:
        assert (stats.expert_hits, stats.expert_misses, stats.bytes_read) == (0, LAYERS * NUM_EXPERTS,
                                                                              LAYERS * NUM_EXPERTS * block)
    assert offload.counters.misses == len(log.passes) * LAYERS * NUM_EXPERTS
    assert result.stats.hit_rate == 0.0
    assert not offload.residency().any(), "nothing stays resident"


def test_no_cache_reads_each_routed_expert_every_pass(make_offloaded):
    _, offload, log, result = generate(make_offloaded, "phimoe", resident=0)
    for needed, after, _, record in log.passes[1:]:
        assert record.fetch.hits == 0 and record.fetch.misses == sum(len(n) for n in needed)
        assert after == [set(), set()]
    assert result.stats.hit_rate == 0.0


def test_a_generation_without_offload_reports_no_reads():
    result = SpecDecoder(tiny_model("qwen3_moe"), drafter=LookupDrafter()).generate(
        torch.tensor([REPETITIVE_PROMPT]), max_new_tokens=6)
    assert result.stats.misses_per_token == 0.0 and result.stats.bytes_read_per_token == 0.0
    assert math.isnan(result.stats.hit_rate) and result.stats.summary()["hit_rate"] is None
    assert all(s.expert_hits == s.expert_misses == s.bytes_read == 0 for s in result.stats.steps)


def test_a_warm_cache_carries_over_to_the_next_generation(make_offloaded):
    model, offload, _, first = generate(make_offloaded, "qwen2_moe", resident=NUM_EXPERTS)
    cold_misses = offload.counters.misses
    residency = offload.residency().clone()
    second = SpecDecoder(model, drafter=LookupDrafter(), offload=offload).generate(
        torch.tensor([REPETITIVE_PROMPT]), max_new_tokens=12)
    assert torch.equal(second.sequences, first.sequences)
    new_experts = int((offload.residency() & ~residency).sum())
    assert offload.counters.misses - cold_misses == new_experts == 0, "the same routing: nothing read again"


def test_summary_describes_the_offload(make_offloaded):
    _, offload = make_offloaded("mixtral", resident=3)
    summary = offload.summary()
    assert summary["offload"] == "disk, 3 resident, lru"
    assert summary["store"] == str(offload.store.path)
    assert summary["base_implementation"] == "grouped_mm"
    payload = offload.store.layout.payload_bytes
    assert summary["experts_mb"] == round(LAYERS * NUM_EXPERTS * payload / 2**20, 3)
    assert summary["resident_mb"] == round(LAYERS * 3 * payload / 2**20, 3)  # the cache proper
    assert summary["scratch_mb"] == round(LAYERS * 2 * TOP_K * payload / 2**20, 3)  # default scratch: 2 * top-k
    _, whole = make_offloaded("mixtral", cache="whole-layer")
    assert whole.summary()["offload"] == "disk, whole-layer fetching"
    _, none = make_offloaded("mixtral", resident=0)
    assert none.summary()["offload"] == "disk, no cache"


def test_measuring_the_fetch_cost_leaves_the_cache_and_the_counters_untouched(make_offloaded):
    reference = tiny_model("olmoe")
    model, offload = make_offloaded("olmoe", resident=NUM_EXPERTS)
    ids = torch.tensor([PLAIN_PROMPT])
    with torch.no_grad():
        model(ids)
    residency, counters = offload.residency().clone(), offload.counters.copy()
    slots = [[t.clone() for t in cache.slots] for cache in offload.caches]
    cost = offload.measure_fetch_cost(counts=(1, 4, 8, 16), repeats=2)
    assert cost.counts == (1, 4, 8) and cost.num_layers == LAYERS
    assert cost.bytes_per_expert == offload.store.layout.block_bytes
    assert torch.equal(offload.residency(), residency) and offload.counters == counters
    for cache, before in zip(offload.caches, slots):
        held = torch.from_numpy(cache.expert_of_slot >= 0)  # [C] the slots holding an expert
        for tensor, saved in zip(cache.slots, before):
            assert torch.equal(tensor[: cache.capacity][held], saved[: cache.capacity][held]), "resident slots kept"
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
    assert offload.counters.since(counters).misses == 0, "the same experts are still resident"
