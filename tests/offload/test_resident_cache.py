"""The resident cache: which experts stay (LRU, LFU), a cache of exactly top-k, passes that need
more experts than it holds (overflow through scratch slots, outputs unchanged), hit and miss counts
against a hand count from the un-offloaded model's routing, and `abort`/`clear`."""

from __future__ import annotations

import pytest
import torch

from moe_spec.errors import InputError
from moe_spec.offload.expert_store import FILE_NAME
from moe_spec.offload.offloaded_experts import OffloadConfig
from moe_spec.offload.resident_cache import Eviction, LayerCache
from moe_spec.testing.helpers import PLAIN_PROMPT, REPETITIVE_PROMPT
from moe_spec.testing.tiny_models import MOE_ARCHITECTURES

from offload_helpers import NUM_EXPERTS, TOP_K, assert_same_logits, assert_slots_hold_their_experts, model_of, routed_experts


def layer_cache(capacity: int, eviction: str = "lru", scratch: int = 2) -> LayerCache:
    return LayerCache(NUM_EXPERTS, capacity, scratch, [(2, 3), (4,)], torch.float32, "cpu", Eviction(eviction))


def resident(cache: LayerCache) -> set[int]:
    return {int(e) for e in cache.resident.nonzero()[0]}


def run(cache: LayerCache, needed: list[int]):
    """One pass whose reads all succeed."""
    plan = cache.plan(needed)
    cache.commit(plan.admitted)
    return plan


def check_plan(plan, needed: list[int], capacity: int) -> None:
    """The plan accounts for every needed expert once, and admits into distinct resident slots."""
    got = [e for e, _ in plan.hits] + [e for e, _ in plan.admitted] + plan.overflow
    assert sorted(got) == sorted(needed)
    slots = [s for _, s in plan.hits] + [s for _, s in plan.admitted]
    assert len(set(slots)) == len(slots) and all(0 <= s < capacity for s in slots)


# ---- eviction order, by hand -----------------------------------------------------------------------

def test_lru_evicts_the_least_recently_used_expert():
    cache = layer_cache(3)
    # (pass, hits, misses, resident afterwards), worked out by hand
    sequence = [
        ([0], 0, 1, {0}),
        ([1], 0, 1, {0, 1}),
        ([2], 0, 1, {0, 1, 2}),
        ([0], 1, 0, {0, 1, 2}),  # 0 used again: 1 is now the least recently used
        ([3], 0, 1, {0, 2, 3}),
        ([4], 0, 1, {0, 3, 4}),
        ([1], 0, 1, {1, 3, 4}),  # 0 was used at pass 4, before 3 and 4
        ([3, 5], 1, 1, {1, 3, 5}),  # 3 is needed, so of {4, 1} the older one (4) goes
    ]
    for needed, hits, misses, after in sequence:
        plan = run(cache, needed)
        check_plan(plan, needed, 3)
        assert (len(plan.hits), plan.misses, plan.overflow) == (hits, misses, []), needed
        assert resident(cache) == after, needed
    # 3 and 5 were both last used at pass 8, 1 at pass 7: 1 goes, then one of the two tied at pass 8
    plan = run(cache, [6, 7])
    assert resident(cache) - {6, 7} in ({3}, {5}) and len(resident(cache)) == 3 and 1 not in resident(cache)


def test_an_evicted_experts_slot_is_reused_for_the_admitted_one():
    cache = layer_cache(2)
    slot_of_0 = run(cache, [0]).admitted[0][1]
    run(cache, [1])
    plan = run(cache, [2])  # 0 is the least recently used
    assert plan.admitted == [(2, slot_of_0)]
    assert cache.expert_of_slot[slot_of_0] == 2 and cache.slot_of_expert[0] == -1


def test_lfu_evicts_the_least_frequently_used_ties_to_the_least_recent():
    cache = layer_cache(3, "lfu")
    for needed in ([0], [0], [0], [1], [1], [2]):  # uses: 0 -> 3, 1 -> 2, 2 -> 1
        run(cache, needed)
    run(cache, [3])  # LRU would evict 0 (used longest ago); LFU evicts 2 (used once)
    assert resident(cache) == {0, 1, 3}
    run(cache, [4])  # 3: one use since its admission
    assert resident(cache) == {0, 1, 4}
    run(cache, [1])  # 0 and 1 now both have 3 uses; 1 more recently
    plan = run(cache, [2, 7])  # 4 (1 use) goes, then of the tied 0 and 1 the least recent: 0
    assert sorted(e for e, _ in plan.admitted) == [2, 7]
    assert resident(cache) == {1, 2, 7}
    run(cache, [2])
    run(cache, [2])
    run(cache, [0])  # 1 and 2 have 3 uses each, 7 one: 7 goes
    assert resident(cache) == {0, 1, 2}


def test_lru_and_lfu_keep_different_experts_on_the_same_passes():
    passes = [[0], [0], [0], [1], [2], [3]]
    kept = {}
    for eviction in ("lru", "lfu"):
        cache = layer_cache(3, eviction)
        for needed in passes:
            run(cache, needed)
        kept[eviction] = resident(cache)
    assert kept == {"lru": {1, 2, 3}, "lfu": {0, 2, 3}}


def test_a_re_admitted_expert_counts_its_uses_from_admission():
    cache = layer_cache(2, "lfu")
    for needed in ([0], [0], [0], [0], [1], [2]):  # 2 evicts 1 (1 use) , not 0 (4 uses)
        run(cache, needed)
    assert resident(cache) == {0, 2}
    run(cache, [2])
    run(cache, [2])
    run(cache, [2])
    run(cache, [2])
    run(cache, [2])  # 2: 6 uses, 0: 4
    run(cache, [1])  # evicts 0
    run(cache, [0])  # 0 comes back with 1 use, and evicts 1 (1 use, older)
    assert resident(cache) == {0, 2}
    run(cache, [3])  # 0's earlier 4 uses are forgotten: it goes, not 2
    assert resident(cache) == {2, 3}


# ---- a cache of exactly top-k ------------------------------------------------------------------------

def test_a_cache_of_exactly_top_k_holds_the_last_passes_experts():
    cache = layer_cache(TOP_K)
    previous: set[int] = set()
    generator = torch.Generator().manual_seed(0)
    for _ in range(40):
        needed = sorted(torch.randperm(NUM_EXPERTS, generator=generator)[:TOP_K].tolist())
        plan = run(cache, needed)
        check_plan(plan, needed, TOP_K)
        assert plan.overflow == []
        assert len(plan.hits) == len(previous & set(needed)) and plan.misses == len(set(needed) - previous)
        assert resident(cache) == set(needed)
        previous = set(needed)


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_a_top_k_cache_decoding_token_by_token_keeps_each_tokens_experts(make_offloaded, arch):
    reference = model_of(arch)
    model, offload = make_offloaded(arch, resident=TOP_K)
    tokens = [PLAIN_PROMPT[i: i + 1] for i in range(6)] + [[7], [7]]
    before = torch.zeros(2, NUM_EXPERTS, dtype=torch.bool)
    for token in tokens:  # one token: K distinct experts per layer, each pass
        ids = torch.tensor([token])
        needed = routed_experts(reference, ids)
        counters = offload.counters.copy()
        with torch.no_grad():
            assert torch.equal(model(ids).logits, reference(ids).logits)
        done = offload.counters.since(counters)
        want_hits = sum(len(set(n) & set(before[l].nonzero().flatten().tolist())) for l, n in enumerate(needed))
        assert (done.hits, done.misses) == (want_hits, TOP_K * 2 - want_hits)
        residency = offload.residency()
        assert [set(row.nonzero().flatten().tolist()) for row in residency] == [set(n) for n in needed]
        before = residency
    assert_slots_hold_their_experts(offload, reference)


# ---- more experts than resident slots ------------------------------------------------------------------

def test_a_pass_needing_more_experts_than_the_cache_overflows():
    cache = layer_cache(3)
    run(cache, [1])
    needed = [0, 1, 2, 3, 4, 5, 6]
    plan = run(cache, needed)
    check_plan(plan, needed, 3)
    assert [e for e, _ in plan.hits] == [1]
    assert len(plan.admitted) == 2 and len(plan.overflow) == 4 and plan.misses == 6
    assert resident(cache) == {1} | {e for e, _ in plan.admitted}
    # no cache at all: everything streams
    nothing = layer_cache(0)
    plan = run(nothing, needed)
    assert (plan.hits, plan.admitted, sorted(plan.overflow)) == ([], [], needed)
    assert resident(nothing) == set()


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss", "deepseek_v3", "olmoe"])
@pytest.mark.parametrize("scratch", [1, 3, None])
def test_overflowing_passes_still_give_the_reference_logits(make_offloaded, arch, scratch):
    reference = model_of(arch)
    model, offload = make_offloaded(arch, resident=TOP_K, scratch=scratch)
    ids = torch.tensor([REPETITIVE_PROMPT + PLAIN_PROMPT])
    needed = routed_experts(reference, ids)
    assert all(len(n) > TOP_K + 1 for n in needed), "the pass overflows (with scratch=1, in several chunks)"
    with torch.no_grad():
        assert_same_logits(model(ids).logits, reference(ids).logits, arch)
    assert (offload.counters.hits, offload.counters.misses) == (0, sum(len(n) for n in needed))
    assert offload.residency().sum(1).tolist() == [TOP_K, TOP_K]
    assert_slots_hold_their_experts(offload, reference)
    with torch.no_grad():  # again, now with TOP_K of them resident
        assert_same_logits(model(ids).logits, reference(ids).logits, arch)
    assert offload.counters.hits == 2 * TOP_K


# ---- hit and miss counts over a sequence of forwards -------------------------------------------------

PASSES = [REPETITIVE_PROMPT[:5], [7], PLAIN_PROMPT[:3], [42, 7], REPETITIVE_PROMPT, [9], [9], PLAIN_PROMPT]


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "phimoe", "deepseek_v3"])
@pytest.mark.parametrize("capacity", [TOP_K, 3, 5, NUM_EXPERTS])
@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_hits_and_misses_match_a_hand_count_from_the_references_routing(make_offloaded, arch, capacity,
                                                                        eviction):
    reference = model_of(arch)
    model, offload = make_offloaded(arch, resident=capacity, eviction=eviction)
    before = [set() for _ in range(2)]  # resident per layer
    seen = [set() for _ in range(2)]
    block = offload.store.layout.block_bytes
    for prompt in PASSES:
        ids = torch.tensor([prompt])
        needed = [set(n) for n in routed_experts(reference, ids)]
        counters = offload.counters.copy()
        with torch.no_grad():
            assert torch.equal(model(ids).logits, reference(ids).logits)
        done = offload.counters.since(counters)
        hits = [len(n & b) for n, b in zip(needed, before)]
        misses = [len(n) - h for n, h in zip(needed, hits)]
        assert (done.hits, done.misses, done.per_layer_misses) == (sum(hits), sum(misses), misses), prompt
        assert done.bytes_read == sum(misses) * block and done.calls == 2
        after = [set(row.nonzero().flatten().tolist()) for row in offload.residency()]
        for layer in range(2):
            seen[layer] |= needed[layer]
            assert needed[layer] & before[layer] <= after[layer], "a hit is never evicted by its own pass"
            assert after[layer] <= before[layer] | needed[layer], "only experts a pass read become resident"
            assert len(after[layer]) == min(capacity, len(seen[layer]))
            if capacity == NUM_EXPERTS:
                assert after[layer] == seen[layer]
        before = after
    assert_slots_hold_their_experts(offload, reference)


# ---- abort and clear ------------------------------------------------------------------------------------

def test_abort_leaves_no_admitted_slot_resident():
    cache = layer_cache(3)
    for needed in ([0], [1], [2]):
        run(cache, needed)
    plan = cache.plan([1, 5, 6])  # 1 hits; 5 and 6 would replace 0 and 2
    assert [e for e, _ in plan.hits] == [1] and sorted(e for e, _ in plan.admitted) == [5, 6]
    cache.abort(plan.admitted)
    assert resident(cache) == {1}, "the failed admissions and their victims are gone, the hit stays"
    for expert, slot in plan.admitted:
        assert cache.expert_of_slot[slot] == -1 and cache.slot_of_expert[expert] == -1
    plan = run(cache, [5])  # an emptied slot is used before any resident expert is evicted
    assert resident(cache) == {1, 5}
    empty = layer_cache(2)
    cache_plan = empty.plan([3, 4])
    empty.abort(cache_plan.admitted)
    assert resident(empty) == set() and (empty.expert_of_slot == -1).all()


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_clear_is_a_cold_start_without_usage_history(eviction):
    passes = [[0], [1], [2], [3], [1], [4], [5]]
    fresh = layer_cache(3, eviction)
    for needed in passes:
        run(fresh, needed)
    used = layer_cache(3, eviction)
    for needed in ([2], [2], [2], [6], [0], [0], [7], [1]):  # a history that would bias what goes next
        run(used, needed)
    used.clear()
    assert resident(used) == set()
    for needed in passes:
        run(used, needed)
    assert resident(used) == resident(fresh)
    assert used.expert_of_slot.tolist() == fresh.expert_of_slot.tolist(), "the same slots, as from new"


def test_clear_forgets_every_resident_expert(make_offloaded):
    reference = model_of("qwen3_moe")
    model, offload = make_offloaded("qwen3_moe", resident=4)
    ids = torch.tensor([PLAIN_PROMPT])
    with torch.no_grad():
        model(ids)
        assert offload.residency().any()
        offload.clear()
        assert not offload.residency().any()
        counters = offload.counters.copy()
        assert torch.equal(model(ids).logits, reference(ids).logits)
    assert offload.counters.since(counters).hits == 0, "a cold start: every expert is read again"


# ---- configuration ------------------------------------------------------------------------------------

def test_cache_configurations_that_cannot_work_are_refused(tmp_path, make_offloaded):
    model = model_of("mixtral")
    with pytest.raises(InputError, match="top-k"):
        from moe_spec.offload.offloaded_experts import offload_experts

        offload_experts(model, OffloadConfig(tmp_path / "a", resident=1))
    assert not any(p.is_meta for p in model.parameters()), "a refused configuration leaves the model as it was"
    assert not (tmp_path / "a" / FILE_NAME).exists(), "refused before any store is written"
    for bad in (dict(resident=-1), dict(resident=2.5), dict(scratch=0), dict(workers=0), dict(tier="ssd"),
                dict(cache="all"), dict(eviction="fifo")):
        with pytest.raises((InputError, ValueError)):
            OffloadConfig(tmp_path, **bad)
    with pytest.raises(InputError, match="CUDA"):
        offload_experts(model, OffloadConfig(tmp_path / "b", tier="host"))
    with pytest.raises(ValueError):
        LayerCache(NUM_EXPERTS, 0, 0, [(2,)], torch.float32, "cpu")
    _, offload = make_offloaded("mixtral", resident=100)  # more than E: all of them
    assert offload.caches[0].capacity == NUM_EXPERTS
