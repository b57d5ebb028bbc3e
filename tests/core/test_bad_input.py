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


GOOD = torch.tensor([REPETITIVE_PROMPT])


@pytest.mark.parametrize("request_, message", [
    ({"input_ids": GOOD.float() + 0.7}, r"input_ids must hold integer token ids, got dtype torch.float32"),
    ({"input_ids": GOOD.float()}, r"input_ids must hold integer token ids"),  # integral floats too: no silent cast
    ({"input_ids": GOOD.bool()}, r"input_ids must hold integer token ids, got dtype torch.bool"),
    ({"input_ids": REPETITIVE_PROMPT}, r"input_ids must be a \[B, T\] integer torch.Tensor, got a list"),
    ({"input_ids": GOOD[0]}, r"input_ids must be a \[B, T\] integer tensor, got shape \(17,\)"),
    ({"temperature": float("nan")}, r"temperature must be a finite number >= 0 \(0: greedy\), got nan"),
    ({"temperature": float("inf")}, r"temperature must be a finite number"),
    ({"temperature": "0.7"}, r"temperature must be a finite number >= 0 \(0: greedy\), got '0.7'"),
    ({"temperature": 1e-30}, r"temperature must be 0 \(greedy\) or at least 1e-06"),
    ({"max_new_tokens": 2.5}, r"max_new_tokens must be an integer >= 1, got 2.5 \(float\)"),
    ({"max_new_tokens": True}, r"max_new_tokens must be an integer >= 1, got True \(bool\)"),
    ({"max_new_tokens": "4"}, r"max_new_tokens must be an integer >= 1, got '4' \(str\)"),
    ({"top_k": 2.5, "temperature": 1.0}, r"top_k must be an integer >= 0 \(0: no top-k filter\), got 2.5"),
    ({"top_k": "5", "temperature": 1.0}, r"top_k must be an integer"),
    ({"top_p": float("nan"), "temperature": 1.0}, r"top_p must be a number in \(0, 1\], got nan"),
    ({"top_p": "0.9", "temperature": 1.0}, r"top_p must be a number in \(0, 1\], got '0.9'"),
    ({"eos_token_id": "2"}, r"eos_token_id must be a token id, a list of them or None, got '2' \(str\)"),
    ({"eos_token_id": 2.0}, r"eos_token_id must be a token id"),
    ({"eos_token_id": [2, "x"]}, r"eos_token_id must hold integer token ids, got 'x' \(str\) in it"),
    ({"eos_token_id": 500}, r"eos_token_id \[500\] outside the target vocabulary \[0, 96\)"),
    ({"eos_token_id": [-1, 2]}, r"eos_token_id \[-1\] outside the target vocabulary"),
    ({"eos_token_id": torch.tensor([[2]])}, r"eos_token_id as a tensor must be 0-D or 1-D integer"),
    ({"attention_mask": torch.ones(1, 17)}, r"attention_mask must be an integer or bool tensor of 0/1, got dtype torch.float32"),
    ({"attention_mask": torch.full((1, 17), 2)}, r"attention_mask must hold only 0 and 1, got \[2\]"),
    ({"attention_mask": [[1] * 17]}, r"attention_mask must be a \[B, T\] tensor of 0/1 or None, got a list"),
    ({"generator": "seed"}, r"generator must be a torch.Generator or None, got 'seed' \(str\)"),
    ({"generator": 42}, r"generator must be a torch.Generator or None, got 42 \(int\)"),
    ({"streamer": object()}, r"streamer must have put\(tokens\) and end\(\) methods"),
], ids=lambda v: None if isinstance(v, str) else "-".join(f"{k}={type(x).__name__}" for k, x in v.items()))
def test_a_bad_value_is_named_before_anything_runs_and_leaves_no_trace(qwen, request_, message):
    """The error names the parameter; the drafter, the controller and the caller's generator are
    untouched, so the next good call equals a fresh decoder's."""
    from moe_spec.drafters.eagle import EagleDrafter
    from moe_spec.policy.static import StaticController

    target, head = qwen

    def decoder():
        return SpecDecoder(target, drafter=EagleDrafter(head, target), controller=StaticController(TreeBudget(8, 3, 2)))

    used = decoder()
    generator = torch.Generator().manual_seed(11)
    bad = {"input_ids": GOOD, "max_new_tokens": 6, "temperature": 1.0, "generator": generator, **request_}
    with pytest.raises(InputError, match=message):
        used.generate(**bad)
    if not isinstance(bad["generator"], torch.Generator):
        generator = torch.Generator().manual_seed(11)
    after = used.generate(GOOD, max_new_tokens=12, temperature=1.0, top_k=20, generator=generator)
    fresh = decoder().generate(GOOD, max_new_tokens=12, temperature=1.0, top_k=20,
                               generator=torch.Generator().manual_seed(11))
    assert torch.equal(after.sequences, fresh.sequences)


def test_integer_ids_of_any_width_decode_as_long(model):
    decoder = SpecDecoder(model, drafter=LookupDrafter())
    expected = decoder.generate(GOOD, max_new_tokens=6).sequences
    for dtype in (torch.int32, torch.int16, torch.uint8):
        assert torch.equal(decoder.generate(GOOD.to(dtype), max_new_tokens=6).sequences, expected), dtype
    mask = torch.ones_like(GOOD)
    for mask_dtype in (torch.bool, torch.int32, torch.long):
        assert torch.equal(decoder.generate(GOOD, attention_mask=mask.to(mask_dtype), max_new_tokens=6).sequences, expected)


@pytest.mark.gpu
def test_on_cuda_a_cuda_generator_is_refused_and_cuda_inputs_decode():
    """Sampling happens on the host, so the generator must be a CPU one; ids and masks may live anywhere."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model = tiny_model("qwen3_moe").cuda()
    decoder = SpecDecoder(model, drafter=LookupDrafter())
    with pytest.raises(InputError, match=r"generator must be a CPU torch.Generator .* got one on cuda"):
        decoder.generate(GOOD.cuda(), temperature=1.0, generator=torch.Generator(device="cuda"), max_new_tokens=4)
    out = decoder.generate(GOOD.cuda(), attention_mask=torch.ones_like(GOOD).cuda(), max_new_tokens=8)
    assert torch.equal(out.sequences, hf_greedy(model, REPETITIVE_PROMPT, 8))
