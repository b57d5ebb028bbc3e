"""The KV cache after random trees and accepted paths equals token-by-token decoding (one row and a
left-padded batch, on a tiny real MoE), and the batch layouts hold for random prompt lengths."""

from __future__ import annotations

from functools import cache

import torch
from hypothesis import given, strategies as st

from moe_spec.core.engine import SpecDecoder
from moe_spec.drafters.lookup import LookupDrafter
from moe_spec.experiments.runner import left_pad
from moe_spec.core.batch_layout import prefill_inputs, removable_columns, repack, step_inputs, tail_layout
from moe_spec.core.forest import StepForest
from moe_spec.core.kv_cache import gather_columns, keep_tree_paths
from moe_spec.core.target import TargetModel
from moe_spec.core.tree import DraftTree, ancestor_mask, path_to
from moe_spec.testing.tiny_models import tiny_model
from tree_strategies import bounded, forests, trees

VOCAB = 96  # the tiny models' vocabulary


@cache
def tiny_target() -> TargetModel:
    return TargetModel(tiny_model("qwen3_moe"))


prompts = st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=10)


@st.composite
def steps(draw, max_steps: int = 3) -> list[tuple[DraftTree, list[int]]]:
    """1..max_steps (tree, accepted path) pairs: random trees over the real vocabulary, a random node's path."""
    out = []
    for _ in range(draw(st.integers(1, max_steps))):
        tree = draw(trees(max_nodes=10, vocab=VOCAB))
        out.append((tree, path_to(tree, draw(st.integers(0, len(tree) - 1)))))
    return out


def sequential_cache(target: TargetModel, tokens: list[int]):
    """The cache of one causal pass over `tokens`: what token-by-token decoding builds."""
    cache_ = target.new_cache()
    ids, mask, positions, _ = prefill_inputs([torch.tensor(tokens)], pad_token=0)
    target.forward_tree(cache_, ids, mask, positions)
    return cache_


def assert_same_columns(cache_, row: int, columns: torch.Tensor, reference) -> None:
    for layer, ref in zip(cache_.layers, reference.layers):
        assert torch.allclose(layer.keys[row][:, columns], ref.keys[0], atol=1e-4)
        assert torch.allclose(layer.values[row][:, columns], ref.values[0], atol=1e-4)


@bounded(25)
@given(prompts, steps())
def test_one_row_cache_after_accepted_paths_is_sequential_decodings(prompt, plan):
    target = tiny_target()
    cache_ = sequential_cache(target, prompt)
    committed = list(prompt)
    for tree, path in plan:
        prefix = len(committed)
        ids, mask, positions = step_inputs(StepForest((tree,)), torch.tensor([prefix]))
        target.forward_tree(cache_, ids, mask, positions)
        keep_tree_paths(cache_, prefix, [path])
        committed += tree.tokens[path].tolist()
        assert cache_.get_seq_length() == len(committed)
    reference = sequential_cache(target, committed)
    assert_same_columns(cache_, 0, torch.arange(len(committed)), reference)
    # and the next token sees the same context through both caches
    probe = (torch.tensor([[7]]), torch.ones(1, 1, 1, dtype=torch.bool), torch.tensor([[len(committed)]]))
    assert torch.allclose(target.forward_tree(cache_, *probe).logits, target.forward_tree(reference, *probe).logits,
                          atol=1e-4)


@bounded(15)
@given(st.lists(st.tuples(prompts, steps(max_steps=3)), min_size=2, max_size=3), st.booleans())
def test_batched_cache_after_compaction_is_each_rows_sequential_cache(rows, repack_every_step):
    """Paths moved to the tree's first columns leave the shorter rows' stale columns behind; with or
    without a repack after every step, each row's valid columns are its sequential cache."""
    target = tiny_target()
    cache_ = target.new_cache()
    ids, mask, positions, valid = prefill_inputs([torch.tensor(p) for p, _ in rows], pad_token=0)
    target.forward_tree(cache_, ids, mask, positions)
    committed = [list(p) for p, _ in rows]
    for step in range(max(len(plan) for _, plan in rows)):
        # a row whose plan ran out verifies its root alone (a plain step) and accepts it
        chosen = [plan[step] if step < len(plan) else (DraftTree.root_only(5), [0]) for _, plan in rows]
        forest = StepForest(tuple(tree for tree, _ in chosen))
        lengths = valid.sum(1)
        ids, tree_mask, positions = step_inputs(forest, lengths)
        target.forward_tree(cache_, ids, tree_mask, positions, prefix_valid=valid)
        paths = [path for _, path in chosen]
        keep_tree_paths(cache_, valid.shape[1], paths)
        valid = tail_layout(valid, paths)
        assert cache_.get_seq_length() == valid.shape[1]
        if repack_every_step:
            index, valid = repack(valid)
            gather_columns(cache_, index)
            assert removable_columns(valid) == 0
        for row, (tree, path) in enumerate(chosen):
            committed[row] += tree.tokens[path].tolist()
    for row, tokens in enumerate(committed):
        columns = valid[row].nonzero().flatten()
        assert columns.numel() == len(tokens)
        assert_same_columns(cache_, row, columns, sequential_cache(target, tokens))


@bounded(200)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=6))
def test_prefill_layout_right_aligns_every_prompt(lengths):
    prompts_ = [torch.arange(3, 3 + n) for n in lengths]
    ids, mask, positions, valid = prefill_inputs(prompts_, pad_token=0)
    width = max(lengths)
    assert ids.shape == valid.shape == positions.shape == (len(lengths), width)
    for row, n in enumerate(lengths):
        assert valid[row].tolist() == [False] * (width - n) + [True] * n
        assert ids[row, width - n:].tolist() == prompts_[row].tolist()
        assert positions[row, width - n:].tolist() == list(range(n))
        for i in range(width):
            seen = mask[row, i].nonzero().flatten().tolist()
            if valid[row, i]:
                assert seen == [j for j in range(width - n, i + 1)], "a token sees its row's earlier tokens"
            else:
                assert seen == [i], "padding sees itself only"


@bounded(200)
@given(forests(max_rows=4, max_nodes=10, vocab=VOCAB), st.lists(st.integers(1, 300), min_size=4, max_size=4))
def test_step_layout_pads_every_row_with_copies_of_its_root(trees_, lengths):
    forest = StepForest(tuple(trees_))
    lengths = torch.tensor(lengths[: forest.rows])
    ids, mask, positions = step_inputs(forest, lengths)
    assert ids.shape == positions.shape == (forest.rows, forest.width)
    assert mask.shape == (forest.rows, forest.width, forest.width)
    for row, tree in enumerate(forest):
        n = len(tree)
        assert torch.equal(ids[row, :n], tree.tokens) and (ids[row, n:] == tree.tokens[0]).all()
        assert torch.equal(mask[row, :n, :n], ancestor_mask(tree))
        assert torch.equal(positions[row, :n], lengths[row] + tree.depths)
        assert (positions[row, n:] == lengths[row]).all()
        assert torch.equal(mask[row, n:], torch.eye(forest.width, dtype=torch.bool)[n:]), "padding sees itself"
        assert not mask[row, :n, n:].any(), "no node sees a padding slot"


@bounded(200)
@given(st.data())
def test_tail_layout_then_repack_keeps_committed_columns_then_the_path_right_aligned(data):
    rows = data.draw(st.integers(1, 5))
    prefix = data.draw(st.integers(1, 12))
    valid = torch.tensor(data.draw(st.lists(st.lists(st.booleans(), min_size=prefix, max_size=prefix),
                                            min_size=rows, max_size=rows)))  # holes anywhere, as steps leave them
    valid[:, -1] = True  # every row has committed a token
    width = data.draw(st.integers(1, 8))
    paths = []
    for _ in range(rows):  # an increasing path of tree slots starting at the root
        rest = data.draw(st.lists(st.integers(1, width - 1), unique=True, max_size=width - 1)) if width > 1 else []
        paths.append([0] + sorted(rest))
    longest = max(len(p) for p in paths)
    tail = tail_layout(valid, paths)
    assert tail.shape == (rows, prefix + longest)
    for row, path in enumerate(paths):
        assert tail[row, :prefix].tolist() == valid[row].tolist()
        assert tail[row, prefix:].tolist() == [True] * len(path) + [False] * (longest - len(path))
    index, new_valid = repack(tail)
    counts = tail.sum(1)
    new_width = int(counts.max())
    assert index.shape == new_valid.shape == (rows, new_width) and removable_columns(tail) == tail.shape[1] - new_width
    for row in range(rows):
        keep = int(counts[row])
        assert new_valid[row].tolist() == [False] * (new_width - keep) + [True] * keep
        assert index[row, new_width - keep:].tolist() == tail[row].nonzero().flatten().tolist()


def reference_greedy(model, prompt: list[int], max_new_tokens: int, eos: int) -> list[int]:
    """Greedy decoding without any cache: the argmax of a full forward per new token."""
    tokens: list[int] = []
    with torch.no_grad():
        while len(tokens) < max_new_tokens and (not tokens or tokens[-1] != eos):
            tokens.append(int(model(torch.tensor([prompt + tokens])).logits[0, -1].argmax()))
    return tokens


@bounded(10)
@given(st.lists(st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=12), min_size=2, max_size=4),
       st.integers(2, 12), st.integers(0, 10 ** 6))
def test_a_batch_with_rows_finishing_early_decodes_each_row_as_alone(prompts_, max_new_tokens, pick):
    """Random prompt lengths, and an EOS taken from one row's own output so that rows finish (and
    leave the batch) at different steps; the lookup drafter makes steps accept several tokens."""
    target = tiny_target()
    free = [reference_greedy(target.model, p, max_new_tokens, eos=-1) for p in prompts_]
    candidates = sorted({t for out in free for t in out})
    eos = candidates[pick % len(candidates)]
    expected = [reference_greedy(target.model, p, max_new_tokens, eos) for p in prompts_]
    ids, mask = left_pad([torch.tensor([p]) for p in prompts_], pad=0)
    result = SpecDecoder(target, drafter=LookupDrafter()).generate(ids, attention_mask=mask,
                                                                   max_new_tokens=max_new_tokens, eos_token_id=eos)
    got = [result.sequences[row, ids.shape[1]: ids.shape[1] + n].tolist()
           for row, n in enumerate(result.stats.new_tokens_per_row)]
    assert got == expected
