"""Offloaded experts are lossless: for every MoE architecture, cache size, batch, drafter, controller
and base implementation, the offloaded model's logits are bit-identical to the un-offloaded model's,
its greedy tokens equal transformers' greedy `generate` on the un-offloaded model, and its sampled
tokens equal the un-offloaded model's draws from the same seeded generator."""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

import pytest
import torch

from moe_spec import LookupDrafter, SpecDecoder
from moe_spec.core.stats import GenerationStats
from moe_spec.core.target import TargetModel
from moe_spec.drafters.eagle import EagleDrafter
from moe_spec.measure.latency import TimingConfig
from moe_spec.measure.profiler import ProfileSettings, build_profile
from moe_spec.policy.registry import AR, MethodContext, build_method, runnable_names
from moe_spec.testing.helpers import PLAIN_PROMPT, REPETITIVE_PROMPT, assert_speculated, hf_greedy, random_eagle_head
from moe_spec.testing.tiny_models import MOE_ARCHITECTURES

from offload_helpers import NUM_EXPERTS, TOP_K, assert_same_logits, assert_served_by_offload, model_of

NEW_TOKENS = 10
CACHES = {
    "C=top_k": dict(resident=TOP_K),
    "C=5": dict(resident=5),
    "C=5, layer ahead": dict(resident=5, layer_ahead=True),
    "C=E": dict(resident=NUM_EXPERTS),
    "no-cache": dict(resident=0),
    "whole-layer": dict(cache="whole-layer"),
}
BATCH_ROWS = [REPETITIVE_PROMPT, PLAIN_PROMPT[:4]]


@lru_cache(maxsize=None)
def reference(arch: str, eager: bool = False, dtype: torch.dtype = torch.float32):
    """The un-offloaded model (never offloaded itself: each test offloads a fresh copy)."""
    return model_of(arch, eager=eager, dtype=dtype)


@lru_cache(maxsize=None)
def reference_greedy(arch: str, prompt: tuple[int, ...], eager: bool = False) -> torch.Tensor:
    return hf_greedy(reference(arch, eager), list(prompt), NEW_TOKENS)


def left_padded(rows, pad=0):
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def assert_each_row_is_greedy(result, ids, arch, eager=False):
    for row, prompt in enumerate(BATCH_ROWS):
        alone = reference_greedy(arch, tuple(prompt), eager)[0, len(prompt):].tolist()
        mine = result.sequences[row, ids.shape[1]:].tolist()[: len(alone)]
        assert mine == alone, f"{arch} row {row}"


# ---- bit identity of a forward ------------------------------------------------------------------

@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
@pytest.mark.parametrize("base", ["grouped_mm", "eager"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_logits_are_bit_identical_to_the_replaced_implementation_for_every_cache(make_offloaded, arch, base,
                                                                                 dtype):
    eager = base == "eager"
    ref = reference(arch, eager, dtype)
    passes = [left_padded([PLAIN_PROMPT, REPETITIVE_PROMPT[:6]]), left_padded([[7, 7, 7], REPETITIVE_PROMPT])]
    with torch.no_grad():
        expected = [ref(input_ids=ids, attention_mask=mask).logits for ids, mask in passes]
    caches = CACHES if dtype == torch.float32 else ["C=top_k", "whole-layer"]  # bf16: the extremes
    for name in caches:
        model, offload = make_offloaded(arch, eager=eager, model_kwargs=dict(dtype=dtype), **CACHES[name])
        assert offload.base == base
        with torch.no_grad():
            for (ids, mask), want in zip(passes, expected):  # the second pass finds a warm cache
                got = model(input_ids=ids, attention_mask=mask).logits
                # every expert resident (C = E) or all of a layer read (whole-layer) under grouped_mm: the
                # reference's one call on the slots; eager always goes row by row
                one_call = base == "grouped_mm" and name in ("C=E", "whole-layer")
                assert_same_logits(got, want, arch, f"{arch} {base} {dtype} {name}: max diff {(got - want).abs().max()}",
                                   streamed=not one_call)
        assert_served_by_offload(model, offload)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "olmoe", "gpt_oss"])
@pytest.mark.parametrize("base", ["grouped_mm", "eager"])
def test_logits_stay_bit_identical_with_three_experts_per_token(make_offloaded, arch, base):
    """With top-3 the order in which a token's rows are summed shows in the last bits."""
    eager = base == "eager"
    ref = model_of(arch, eager=eager, num_experts_per_tok=3)
    ids, mask = left_padded([PLAIN_PROMPT, REPETITIVE_PROMPT[:6]])
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask).logits
    for config in (dict(resident=3), dict(resident=6), dict(resident=0), dict(cache="whole-layer")):
        model, offload = make_offloaded(arch, eager=eager, model_kwargs=dict(num_experts_per_tok=3), **config)
        assert offload.top_k == 3
        with torch.no_grad():
            assert_same_logits(model(input_ids=ids, attention_mask=mask).logits, want, arch, f"{arch} {base} {config}")


# ---- greedy decoding ----------------------------------------------------------------------------

@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
@pytest.mark.parametrize("cache", list(CACHES))
def test_greedy_lookup_tree_decoding_is_token_identical_for_every_cache(make_offloaded, arch, cache):
    model, offload = make_offloaded(arch, **CACHES[cache])
    decoder = SpecDecoder(model, drafter=LookupDrafter(), offload=offload)
    drafted = 0
    for prompt in (REPETITIVE_PROMPT, PLAIN_PROMPT):  # the second generation starts from a warm cache
        result = decoder.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS)
        assert torch.equal(result.sequences, reference_greedy(arch, tuple(prompt))), f"{arch} {cache} {prompt[:4]}"
        drafted += sum(s.tree_size for s in result.stats.steps)
    assert drafted > 0, "trees were verified through the offloaded experts"
    assert_served_by_offload(model, offload)


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_left_padded_batch_rows_equal_each_prompt_decoded_alone(make_offloaded, arch):
    model, offload = make_offloaded(arch, resident=3)
    ids, mask = left_padded(BATCH_ROWS)
    result = SpecDecoder(model, drafter=LookupDrafter(), offload=offload).generate(
        ids, attention_mask=mask, max_new_tokens=NEW_TOKENS)
    assert max(step.rows for step in result.stats.steps) == 2
    assert_each_row_is_greedy(result, ids, arch)


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_eagle_tree_decoding_is_token_identical_alone_and_in_a_batch(make_offloaded, arch):
    model, offload = make_offloaded(arch, resident=TOP_K)
    target = TargetModel(model, offload=offload)
    decoder = SpecDecoder(target, drafter=EagleDrafter(random_eagle_head(target), target))
    result = decoder.generate(torch.tensor([PLAIN_PROMPT]), max_new_tokens=NEW_TOKENS)
    assert torch.equal(result.sequences, reference_greedy(arch, tuple(PLAIN_PROMPT)))
    assert sum(s.tree_size for s in result.stats.steps) > 0
    ids, mask = left_padded(BATCH_ROWS)
    assert_each_row_is_greedy(decoder.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS), ids, arch)


@lru_cache(maxsize=None)
def reference_profile(arch: str):
    settings = ProfileSettings(max_new_tokens=16, prefix_len=8, grid_tokens=(1, 4), grid_experts=(2, 4),
                               natural_trees=3, curve_sizes=(1, 2, 4), timing=TimingConfig(2, 1, 0))
    prompts = [torch.tensor(p) for p in (REPETITIVE_PROMPT, PLAIN_PROMPT, PLAIN_PROMPT + REPETITIVE_PROMPT,
                                         [30, 31, 32, 33] * 4)]
    profile = build_profile(TargetModel(reference(arch)), LookupDrafter(), prompts, settings)
    # a verify pass with a slow machine's fixed cost, so that speculating pays and every cost-aware
    # method drafts: the lossless check needs drafts to check (its pricing runs either way)
    return replace(profile, cost_model=replace(profile.cost_model, base_ms=profile.cost_model.base_ms + 50.0))


@pytest.mark.parametrize("method", [name for name in runnable_names() if name != AR])
@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_registry_controllers_stay_lossless(make_offloaded, arch, method):
    """Every drafting method of the registry on every MoE architecture (the README's claim)."""
    model, offload = make_offloaded(arch, resident=3)
    target = TargetModel(model, offload=offload)
    built = build_method(method, MethodContext(target, LookupDrafter, lambda: reference_profile(arch)))
    assert built.controller is not None
    if method == "moe-aware":
        sizing = built.controller.sizing  # bounded by fixed budgets in a real run
        assert sizing.residency is not None, "the controller reads the cache's residency"
    decoder = SpecDecoder(target, drafter=built.drafter, controller=built.controller)
    steps = []
    for prompt in (REPETITIVE_PROMPT, PLAIN_PROMPT + REPETITIVE_PROMPT):
        result = decoder.generate(torch.tensor([prompt]), max_new_tokens=24)
        assert torch.equal(result.sequences, hf_greedy(reference(arch), prompt, 24)), f"{arch} {method}"
        steps += result.stats.steps
    assert_speculated(GenerationStats(steps=steps))


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_eager_base_decoding_equals_the_eager_reference(make_offloaded, arch):
    # (every cache under the eager base is covered bit for bit by the logits test above)
    model, offload = make_offloaded(arch, eager=True, resident=5)
    assert offload.base == "eager"
    decoder = SpecDecoder(model, drafter=LookupDrafter(), offload=offload)
    result = decoder.generate(torch.tensor([REPETITIVE_PROMPT]), max_new_tokens=NEW_TOKENS)
    assert torch.equal(result.sequences, reference_greedy(arch, tuple(REPETITIVE_PROMPT), eager=True))
    ids, mask = left_padded(BATCH_ROWS)
    assert_each_row_is_greedy(decoder.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS), ids, arch,
                              eager=True)


# ---- sampling: the same draws ---------------------------------------------------------------------

SAMPLING = dict(temperature=1.0, top_p=0.9, eos_token_id=[])


def sampled(decoder, seed: int, rows=([PLAIN_PROMPT], BATCH_ROWS)) -> list[torch.Tensor]:
    """One generation per request in `rows`, in turn, from one generator seeded `seed`."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for prompts in rows:
        ids, mask = left_padded(prompts)
        out.append(decoder.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, generator=generator,
                                    **SAMPLING).sequences)
    return out


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_sampled_tokens_equal_the_unoffloaded_draws(make_offloaded, arch):
    model, offload = make_offloaded(arch, resident=3)
    mine = SpecDecoder(model, drafter=LookupDrafter(), offload=offload)
    theirs = SpecDecoder(reference(arch), drafter=LookupDrafter())
    expected = sampled(theirs, seed=5)
    assert [torch.equal(a, b) for a, b in zip(sampled(mine, seed=5), expected)] == [True] * len(expected)
    other = sampled(theirs, seed=6, rows=([PLAIN_PROMPT],))
    assert not torch.equal(other[0], expected[0]), "the draws depend on the seed (the comparison can fail)"


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_sampled_eagle_trees_under_a_registry_controller_equal_the_unoffloaded_draws(make_offloaded, arch):
    model, offload = make_offloaded(arch, resident=TOP_K)

    def decoder(target):
        head = random_eagle_head(target)
        built = build_method("static:4@sampled", MethodContext(target, lambda: EagleDrafter(head, target)))
        return SpecDecoder(target, drafter=built.drafter, controller=built.controller)

    expected = sampled(decoder(TargetModel(reference(arch))), seed=9)
    got = sampled(decoder(TargetModel(model, offload=offload)), seed=9)
    assert [torch.equal(a, b) for a, b in zip(got, expected)] == [True] * len(expected)
    assert offload.counters.misses > 0
