"""A tree forward (4D mask, depth positions) and cache compaction equal sequential decoding."""

import pytest
import torch

from moe_spec.core.kv_cache import keep_tree_paths
from moe_spec.core.target import TargetModel
from moe_spec.testing.tiny_models import tiny_model
from moe_spec.core.tree import DraftTree, ancestor_mask, path_to, root_to_leaf_paths

from moe_spec.testing.helpers import ALL_ARCHITECTURES

PREFIX = [3, 14, 15, 9, 26, 5, 35, 8, 9, 7, 9]
TREE = DraftTree.from_lists([40, 41, 42, 43, 44, 45, 46, 47], [-1, 0, 0, 1, 1, 2, 3, 3])


def _attention_variants():
    for arch in ALL_ARCHITECTURES:
        yield arch, "eager"
        if arch != "gpt_oss":  # GPT-OSS has no SDPA path
            yield arch, "sdpa"


def _prefill(target, tokens):
    cache = target.new_cache()
    n = len(tokens)
    out = target.forward_tree(cache, torch.tensor([tokens]), torch.tril(torch.ones(n, n, dtype=torch.bool))[None], torch.arange(n)[None])
    return cache, out


def _sequential_logits(model, tokens):
    """Logits at every position of a plain causal forward (the reference)."""
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


@pytest.mark.parametrize("arch,attention", list(_attention_variants()))
def test_tree_logits_equal_sequential_logits_per_path(arch, attention):
    model = tiny_model(arch, attn_implementation=attention)
    target = TargetModel(model)
    cache, _ = _prefill(target, PREFIX)
    p = len(PREFIX)
    out = target.forward_tree(cache, TREE.tokens[None], ancestor_mask(TREE)[None], (p + TREE.depths)[None])
    for path in root_to_leaf_paths(TREE):
        reference = _sequential_logits(model, PREFIX + TREE.tokens[path].tolist())[p:]
        torch.testing.assert_close(out.logits[0, path], reference, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("arch,attention", list(_attention_variants()))
def test_compacted_cache_continues_like_sequential_decoding(arch, attention):
    model = tiny_model(arch, attn_implementation=attention)
    target = TargetModel(model)
    cache, _ = _prefill(target, PREFIX)
    p = len(PREFIX)
    target.forward_tree(cache, TREE.tokens[None], ancestor_mask(TREE)[None], (p + TREE.depths)[None])
    accepted = path_to(TREE, 6)  # root -> 1 -> 3 -> 6, not a contiguous prefix of the nodes
    keep_tree_paths(cache, p, [accepted])
    assert cache.get_seq_length() == p + len(accepted)
    sequence = PREFIX + TREE.tokens[accepted].tolist()
    # continue with a second tree over the compacted cache
    follow = DraftTree.from_lists([50, 51, 52], [-1, 0, 1])
    q = cache.get_seq_length()
    out = target.forward_tree(cache, follow.tokens[None], ancestor_mask(follow)[None], (q + follow.depths)[None])
    reference = _sequential_logits(model, sequence + follow.tokens.tolist())[q:]
    torch.testing.assert_close(out.logits[0], reference, atol=2e-5, rtol=1e-4)


def test_gpt_oss_sliding_window_is_enforced_beyond_the_window():
    """The prefix is longer than the sliding window, so the window must cut in on sliding layers."""
    model = tiny_model("gpt_oss")
    assert model.config.sliding_window < len(PREFIX) + 3
    target = TargetModel(model)
    cache, _ = _prefill(target, PREFIX)
    p = len(PREFIX)
    out = target.forward_tree(cache, TREE.tokens[None], ancestor_mask(TREE)[None], (p + TREE.depths)[None])
    path = path_to(TREE, 6)
    reference = _sequential_logits(model, PREFIX + TREE.tokens[path].tolist())[p:]
    torch.testing.assert_close(out.logits[0, path], reference, atol=2e-5, rtol=1e-4)
