"""Lossless greedy decoding: SpecDecoder's tokens equal transformers' greedy `generate`."""

import pytest
import torch

from moe_spec import LookupDrafter, SpecDecoder
from moe_spec.testing.tiny_models import tiny_model

from moe_spec.testing.helpers import ALL_ARCHITECTURES, PLAIN_PROMPT, REPETITIVE_PROMPT, hf_greedy

NEW_TOKENS = 24


@pytest.mark.parametrize("arch", ALL_ARCHITECTURES)
@pytest.mark.parametrize("seed", [0, 1])
def test_lookup_tree_decoding_equals_hf_greedy(arch, seed):
    model = tiny_model(arch, seed=seed)
    decoder = SpecDecoder(model, drafter=LookupDrafter())
    for prompt in (REPETITIVE_PROMPT, PLAIN_PROMPT):
        expected = hf_greedy(model, prompt, NEW_TOKENS)
        result = decoder.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS)
        assert torch.equal(result.sequences, expected), f"{arch} seed {seed} prompt {prompt[:4]}..."


@pytest.mark.parametrize("arch", ALL_ARCHITECTURES)
def test_drafts_are_accepted_on_repetitive_prompts(arch):
    model = tiny_model(arch)
    result = SpecDecoder(model, drafter=LookupDrafter()).generate(
        torch.tensor([REPETITIVE_PROMPT * 2]), max_new_tokens=NEW_TOKENS, eos_token_id=[]
    )
    assert result.stats.mean_accept_len > 1.0
    assert any(step.tree_size > 1 for step in result.stats.steps), "trees, not just chains, were verified"


@pytest.mark.parametrize("arch", ALL_ARCHITECTURES)
def test_autoregressive_baseline_equals_hf_greedy(arch):
    model = tiny_model(arch)
    result = SpecDecoder(model).generate(torch.tensor([PLAIN_PROMPT]), max_new_tokens=12)
    assert torch.equal(result.sequences, hf_greedy(model, PLAIN_PROMPT, 12))
    assert all(step.tree_size == 0 and step.accepted_length == 1 for step in result.stats.steps)


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_eager_attention_also_lossless(arch):
    model = tiny_model(arch, attn_implementation="eager")
    result = SpecDecoder(model, drafter=LookupDrafter()).generate(
        torch.tensor([REPETITIVE_PROMPT]), max_new_tokens=NEW_TOKENS
    )
    assert torch.equal(result.sequences, hf_greedy(model, REPETITIVE_PROMPT, NEW_TOKENS))


def test_max_new_tokens_is_exact_even_when_a_step_accepts_more():
    model = tiny_model("qwen3_moe")
    decoder = SpecDecoder(model, drafter=LookupDrafter())
    for budget in (1, 2, 3, 7):
        result = decoder.generate(torch.tensor([REPETITIVE_PROMPT]), max_new_tokens=budget, eos_token_id=[])
        assert result.sequences.shape[1] == len(REPETITIVE_PROMPT) + budget
        assert result.stats.new_tokens == budget
        assert torch.equal(result.sequences, hf_greedy(model, REPETITIVE_PROMPT, budget))


def test_eos_inside_an_accepted_path_stops_there():
    model = tiny_model("mixtral")
    reference = hf_greedy(model, REPETITIVE_PROMPT, NEW_TOKENS)[0, len(REPETITIVE_PROMPT):].tolist()
    assert len(reference) == NEW_TOKENS and model.generation_config.eos_token_id not in reference
    eos = reference[5]  # the 6th generated token acts as EOS
    first = reference.index(eos)
    result = SpecDecoder(model, drafter=LookupDrafter()).generate(
        torch.tensor([REPETITIVE_PROMPT]), max_new_tokens=NEW_TOKENS, eos_token_id=eos
    )
    assert result.sequences[0, len(REPETITIVE_PROMPT):].tolist() == reference[: first + 1]
