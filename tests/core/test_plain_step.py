"""The plain decoding step's shortcuts change nothing: an unmasked root-only pass equals the masked one,
a prefill's last logits equal the full pass's last column, features come only when asked for."""

from __future__ import annotations

import pytest
import torch

from moe_spec.core.batch_layout import prefill_inputs, step_inputs
from moe_spec.core.engine import SpecDecoder
from moe_spec.core.forest import StepForest
from moe_spec.core.target import TargetModel
from moe_spec.core.tree import DraftTree
from moe_spec.testing.helpers import PLAIN_PROMPT, REPETITIVE_PROMPT, hf_greedy
from moe_spec.testing.tiny_models import tiny_model


@pytest.fixture(scope="module", params=["qwen3_moe", "gpt_oss"])
def target(request):
    return TargetModel(tiny_model(request.param))


def _prefilled(target: TargetModel, prompt: list[int]):
    cache = target.new_cache()
    ids, mask, positions, _ = prefill_inputs([torch.tensor(prompt)], pad_token=0)
    full = target.forward_tree(cache, ids, mask, positions)
    return cache, full


@pytest.mark.parametrize("prompt_len", [6, 10])  # GPT-OSS's tiny window is 8: inside it, then past it
def test_root_only_pass_without_a_mask_equals_the_masked_pass(target, prompt_len):
    cache, _ = _prefilled(target, PLAIN_PROMPT[:prompt_len])
    p = cache.get_seq_length()
    token, position = torch.tensor([[7]]), torch.tensor([[p]])
    unmasked = target.forward_tree(cache, token, torch.ones(1, 1, 1, dtype=torch.bool), position)
    cache.crop(-1)
    # the same pass with explicit additive masks, through the model itself: every column visible, and
    # for sliding layers only the keys within the window of position p
    mask = target._additive(torch.ones(1, 1, p + 1, dtype=torch.bool))
    if target.sliding_window is not None:
        in_window = (p - torch.arange(p + 1)) < target.sliding_window
        mask = {"full_attention": mask, "sliding_attention": target._additive(in_window[None, None])}
    masked = target.model(input_ids=token, attention_mask=mask, position_ids=position, past_key_values=cache,
                          use_cache=True)
    torch.testing.assert_close(unmasked.logits, masked.logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(unmasked.logits.argmax(-1), masked.logits.argmax(-1))


def test_a_hidden_prefix_column_still_gets_a_mask(target):
    """A root that must not see a cached column (a batch's padding) is masked: the shortcut is only for
    a fully visible cache."""
    cache, _ = _prefilled(target, PLAIN_PROMPT)
    p = cache.get_seq_length()
    token, position = torch.tensor([[7]]), torch.tensor([[p - 1]])
    hidden = torch.ones(1, p, dtype=torch.bool)
    hidden[0, 0] = False
    masked = target.forward_tree(cache, token, torch.ones(1, 1, 1, dtype=torch.bool), position, prefix_valid=hidden)
    cache.crop(-1)
    seen = target.forward_tree(cache, token, torch.ones(1, 1, 1, dtype=torch.bool), position)
    assert not torch.allclose(masked.logits, seen.logits), "hiding column 0 must change the pass"


def test_prefill_last_logits_and_features_only_when_asked(target):
    _, full = _prefilled(target, REPETITIVE_PROMPT)
    cache = target.new_cache()
    ids, mask, positions, _ = prefill_inputs([torch.tensor(REPETITIVE_PROMPT)], pad_token=0)
    last = target.forward_tree(cache, ids, mask, positions, features=False, last_logits_only=True)
    assert last.logits.shape == (1, 1, full.logits.shape[-1]) and last.features is None
    torch.testing.assert_close(last.logits[:, -1], full.logits[:, -1], rtol=1e-5, atol=1e-5)
    assert full.features.shape[:3] == (1, len(REPETITIVE_PROMPT), len(target.feature_layers))
    assert torch.equal(last.routing.experts, full.routing.experts)


def test_roots_alone_lay_out_one_token_per_row_at_its_next_position():
    forest = StepForest([DraftTree.root_only(3), DraftTree.root_only(9)])
    ids, mask, positions = step_inputs(forest, torch.tensor([5, 2]))
    assert ids.tolist() == [[3], [9]] and positions.tolist() == [[5], [2]] and mask.shape == (2, 1, 1) and bool(mask.all())


def test_plain_decoding_of_a_padded_batch_equals_each_row_alone(target):
    rows = [PLAIN_PROMPT, REPETITIVE_PROMPT[:7]]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    result = SpecDecoder(target).generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=[])
    for b, row in enumerate(rows):
        alone = target.model.generate(torch.tensor([row]), attention_mask=torch.ones(1, len(row), dtype=torch.long),
                                      do_sample=False, max_new_tokens=12, eos_token_id=None, pad_token_id=0)
        assert result.sequences[b, width:].tolist() == alone[0, len(row):].tolist(), b
    assert torch.equal(SpecDecoder(target).generate(torch.tensor([PLAIN_PROMPT]), max_new_tokens=12).sequences,
                       hf_greedy(target.model, PLAIN_PROMPT, 12))
