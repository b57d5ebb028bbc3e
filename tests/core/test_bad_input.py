"""Bad input gets a clear error naming the problem, and the decoder stays usable afterwards."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from moe_spec import DrafterError, InputError, LookupDrafter, SpecDecoder, TreeBudget, UnsupportedArchitectureError
from moe_spec.testing.tiny_models import tiny_model
from moe_spec.core.tree import DraftTree

from moe_spec.testing.helpers import PLAIN_PROMPT, REPETITIVE_PROMPT, hf_greedy


class OutOfVocabularyDrafter:
    """A drafter whose draft vocabulary is larger than the target's."""

    default_budget = TreeBudget(4, 2, 2)

    def begin(self, prompt, features):
        pass

    def propose(self, root_token, budget, sampling):
        return DraftTree.from_lists([root_token, 10_000], [-1, 0])

    def commit(self, tokens, features):
        pass


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3_moe")


def _still_usable(decoder, model):
    result = decoder.generate(torch.tensor([REPETITIVE_PROMPT]), max_new_tokens=8)
    assert torch.equal(result.sequences, hf_greedy(model, REPETITIVE_PROMPT, 8))


def test_unsupported_architecture_is_named_with_the_supported_list():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50))
    with pytest.raises(UnsupportedArchitectureError, match=r"'gpt2'.*supported model types: .*qwen3_moe"):
        SpecDecoder(gpt2)


def test_drafter_tokens_outside_the_vocabulary(model):
    decoder = SpecDecoder(model, drafter=OutOfVocabularyDrafter())
    with pytest.raises(DrafterError, match="outside the target vocabulary"):
        decoder.generate(torch.tensor([PLAIN_PROMPT]), max_new_tokens=4)
    decoder.drafter = LookupDrafter()
    _still_usable(decoder, model)


def test_empty_prompt(model):
    decoder = SpecDecoder(model, drafter=LookupDrafter())
    with pytest.raises(InputError, match="empty"):
        decoder.generate(torch.zeros(1, 0, dtype=torch.long), max_new_tokens=4)
    _still_usable(decoder, model)


def test_prompt_beyond_the_context(model):
    decoder = SpecDecoder(model, drafter=LookupDrafter())
    limit = model.config.max_position_embeddings
    with pytest.raises(InputError, match=f"context of {limit}"):
        decoder.generate(torch.tensor([PLAIN_PROMPT]), max_new_tokens=limit)
    _still_usable(decoder, model)


def test_bad_batches(model):
    decoder = SpecDecoder(model, drafter=LookupDrafter())
    two = torch.tensor([PLAIN_PROMPT, PLAIN_PROMPT])
    with pytest.raises(InputError, match="attention_mask shape"):
        decoder.generate(two, attention_mask=torch.ones(2, 3), max_new_tokens=4)
    with pytest.raises(InputError, match="row 1 of the batch is empty"):
        decoder.generate(two, attention_mask=torch.tensor([[1] * 10, [0] * 10]), max_new_tokens=4)
    with pytest.raises(InputError, match="row 0: attention_mask must be left padding"):
        decoder.generate(two, attention_mask=torch.tensor([[1] * 8 + [0, 0], [1] * 10]), max_new_tokens=4)
    with pytest.raises(InputError, match="streamer needs a single prompt"):
        decoder.generate(two, max_new_tokens=4, streamer=object())
    _still_usable(decoder, model)


def test_prompt_ids_outside_the_vocabulary_and_bad_settings(model):
    decoder = SpecDecoder(model)
    with pytest.raises(InputError, match="outside the target vocabulary"):
        decoder.generate(torch.tensor([[1, 2, 500]]), max_new_tokens=4)
    with pytest.raises(InputError, match="top_p"):
        decoder.generate(torch.tensor([PLAIN_PROMPT]), max_new_tokens=4, temperature=1.0, top_p=0.0)
    with pytest.raises(InputError, match="max_new_tokens"):
        decoder.generate(torch.tensor([PLAIN_PROMPT]), max_new_tokens=0)
    with pytest.raises(InputError, match="left padding"):
        decoder.generate(torch.tensor([PLAIN_PROMPT]), attention_mask=torch.tensor([[1] * 9 + [0]]), max_new_tokens=4)
    _still_usable(decoder, model)


def test_left_padding_is_stripped_for_a_single_prompt(model):
    decoder = SpecDecoder(model, drafter=LookupDrafter())
    padded = torch.tensor([[0, 0] + REPETITIVE_PROMPT])
    mask = torch.tensor([[0, 0] + [1] * len(REPETITIVE_PROMPT)])
    result = decoder.generate(padded, attention_mask=mask, max_new_tokens=8)
    expected = hf_greedy(model, REPETITIVE_PROMPT, 8)
    assert torch.equal(result.sequences[:, 2:], expected), "the input comes back as given, padding included"


def test_flash_style_attention_is_refused():
    model = tiny_model("mixtral")
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(UnsupportedArchitectureError, match="cannot take a tree mask"):
        SpecDecoder(model)
