"""A config's sliding window is honoured as transformers honours it: in the prefill, in every tree
pass, for every drafter, in batches and with offloaded experts, on every architecture whose config
can carry one, with prompts longer than the window.

Windows of 8 tokens against 41-token prompts: past the window almost every key is outside it, so a
mask that ignored it would decode other tokens (the last test shows that it does)."""

import pytest
import torch

from moe_spec.experiments.runner import left_pad
from moe_spec import LookupDrafter, SpecDecoder, TreeBudget
from moe_spec.policy.static import StaticController
from moe_spec.core.target import TargetModel
from moe_spec.drafters.eagle import EagleDrafter
from moe_spec.offload.offloaded_experts import OffloadConfig, offload_experts
from moe_spec.testing.helpers import PLAIN_PROMPT, REPETITIVE_PROMPT, assert_speculated, hf_greedy, random_eagle_head
from moe_spec.testing.tiny_models import WINDOWED_ARCHITECTURES, sliding_window_overrides, tiny_model

WINDOW = 8
PROMPT = REPETITIVE_PROMPT + PLAIN_PROMPT + REPETITIVE_PROMPT[:14]  # 41 tokens, repeats for the lookup drafter
NEW_TOKENS = 32
# seeds whose greedy continuation repeats within NEW_TOKENS (and meets no EOS), so that the lookup
# drafter has drafts to get accepted
SEEDS = {"mistral": 1, "mixtral": 1, "phimoe": 1, "qwen3_moe": 0, "qwen2_moe": 0, "gpt_oss": 0}


def windowed(arch: str, attention: str | None = None):
    return tiny_model(arch, seed=SEEDS[arch], attn_implementation=attention, **sliding_window_overrides(arch, WINDOW))


def _variants():
    for arch in WINDOWED_ARCHITECTURES:
        for attention in ("eager", "sdpa"):
            if not (arch == "gpt_oss" and attention == "sdpa"):  # GPT-OSS has no SDPA path
                yield arch, attention


def _drafter(name: str, target: TargetModel):
    if name == "lookup":
        return LookupDrafter()
    return EagleDrafter(random_eagle_head(target), target, TreeBudget(12, 4, 3))


@pytest.mark.parametrize("drafter", ["lookup", "eagle"])
@pytest.mark.parametrize("arch,attention", list(_variants()))
def test_decoding_past_the_window_equals_transformers_greedy(arch, attention, drafter):
    model = windowed(arch, attention)
    target = TargetModel(model)
    assert target.sliding_window == WINDOW < len(PROMPT)
    result = SpecDecoder(target, drafter=_drafter(drafter, target)).generate(torch.tensor([PROMPT]),
                                                                            max_new_tokens=NEW_TOKENS)
    assert torch.equal(result.sequences, hf_greedy(model, PROMPT, NEW_TOKENS)), f"{arch} {attention} {drafter}"
    if drafter == "lookup":
        assert_speculated(result.stats)  # the random head may draft nothing the target accepts


@pytest.mark.parametrize("arch", WINDOWED_ARCHITECTURES)
def test_a_ragged_batch_past_the_window_decodes_each_row_as_alone(arch):
    """Left padding shifts cache columns from positions: the window counts positions, as transformers'
    masks do over a row's own tokens."""
    model = windowed(arch)
    rows = [PROMPT, PLAIN_PROMPT + REPETITIVE_PROMPT, REPETITIVE_PROMPT[:6]]
    ids, mask = left_pad([torch.tensor([r]) for r in rows], pad=0)  # [B, width] each
    width = ids.shape[1]
    target = TargetModel(model)
    for drafter in ("lookup", "eagle"):
        result = SpecDecoder(target, drafter=_drafter(drafter, target), controller=StaticController(
            TreeBudget(8, 4, 2))).generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS)
        for row, prompt in enumerate(rows):
            alone = hf_greedy(model, prompt, NEW_TOKENS)[0, len(prompt):].tolist()
            assert result.sequences[row, width:].tolist()[: len(alone)] == alone, f"{arch} {drafter} row {row}"
        if drafter == "lookup":
            assert_speculated(result.stats)


@pytest.mark.parametrize("arch", [a for a in WINDOWED_ARCHITECTURES if a != "mistral"])  # mistral: no experts
def test_offloaded_experts_past_the_window_equal_transformers_greedy(arch, tmp_path):
    model = windowed(arch)
    offload = offload_experts(model, OffloadConfig(tmp_path / "store", tier="disk", resident=2))
    try:
        result = SpecDecoder(model, drafter=LookupDrafter(), offload=offload).generate(torch.tensor([PROMPT]),
                                                                                    max_new_tokens=NEW_TOKENS)
    finally:
        offload.close()
    assert torch.equal(result.sequences, hf_greedy(windowed(arch), PROMPT, NEW_TOKENS))
    assert_speculated(result.stats)
    assert result.stats.misses_per_token > 0


@pytest.mark.parametrize("arch", ["mistral", "mixtral", "qwen2_moe"])
def test_a_mask_that_ignores_the_window_decodes_other_tokens(arch):
    """The deliberately broken variant: the same decoder with its window taken away fails the identity
    the tests above hold, so they can fail."""
    model = windowed(arch)
    target = TargetModel(model)
    target.window = None
    broken = SpecDecoder(target, drafter=LookupDrafter()).generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS)
    assert not torch.equal(broken.sequences, hf_greedy(model, PROMPT, NEW_TOKENS))
