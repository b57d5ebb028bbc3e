"""EagleBatchDrafter: B rows drafted together give each row the tree it gets alone, and batched
EAGLE decoding stays lossless on every architecture."""

from __future__ import annotations

import pytest
import torch

from moe_spec.core.drafting import TreeBudget
from moe_spec.drafters.eagle import EagleDrafter
from moe_spec.drafters.eagle_batch import EagleBatchDrafter
from moe_spec.core.engine import SpecDecoder
from moe_spec.core.sampling import SamplingConfig
from moe_spec.core.target import TargetModel
from moe_spec.testing.tiny_models import tiny_model
from moe_spec.core.tree import DraftTree, path_to

from moe_spec.testing.helpers import ALL_ARCHITECTURES, hf_greedy, random_eagle_head

torch.set_num_threads(1)
DRAFT_VOCAB = 64
LENGTHS = [12, 5, 20]


def _features(target: TargetModel, tokens: torch.Tensor) -> torch.Tensor:
    """[T, S, D] the target's feature layers for a token sequence."""
    hidden = target.model(tokens[None], output_hidden_states=True).hidden_states
    return torch.stack([hidden[i][0] for i in target.feature_layers], dim=1).detach()


def _prompts(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (n,), generator=g) for n in LENGTHS]


def _pair(target, head, prompts):
    """Per-row drafters and one batch drafter, all begun on the prompts minus their roots."""
    singles = [EagleDrafter(head, target) for _ in prompts]
    features = [_features(target, p[:-1]) for p in prompts]
    for drafter, prompt, f in zip(singles, prompts, features):
        drafter.begin(prompt[:-1], f)
    batch = EagleBatchDrafter(head, target, len(prompts))
    batch.begin([p[:-1] for p in prompts], features)
    return singles, batch


def _assert_same_trees(batched, alone):
    for b, (mine, theirs) in enumerate(zip(batched, alone)):
        assert torch.equal(mine.tokens, theirs.tokens), f"row {b}"
        assert torch.equal(mine.parents, theirs.parents), f"row {b}"
        assert torch.allclose(mine.scores, theirs.scores, atol=1e-4), f"row {b}"


def _single(drafter: EagleDrafter, root: int, budget: TreeBudget, depth: int, sampling: SamplingConfig):
    return drafter.propose(root, budget.capped(depth), sampling) if depth > 0 else DraftTree.root_only(root)


@pytest.mark.parametrize("budget", [TreeBudget(60, 5, 10), TreeBudget(7, 3, 4), TreeBudget(1, 1, 1), TreeBudget(12, 6, 3)])
@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(0.7, top_k=5, top_p=0.9)])
def test_each_rows_tree_is_the_tree_it_gets_alone_over_several_steps(qwen, budget, sampling):
    target, head = qwen
    prompts = _prompts()
    singles, batch = _pair(target, head, prompts)
    roots = [int(p[-1]) for p in prompts]
    g = torch.Generator().manual_seed(1)
    for step, depths in enumerate([[5, 5, 5], [2, 0, 5], [1, 3, 0]]):
        batched = batch.propose(roots, budget, depths, sampling)
        alone = [_single(d, r, budget, depth, sampling) for d, r, depth in zip(singles, roots, depths)]
        _assert_same_trees(batched, alone)
        # accept a random path per row; the same committed tokens and features go to both
        tokens, features = [], []
        for tree in alone:
            node = int(torch.randint(len(tree), (1,), generator=g))
            path = path_to(tree, node)
            tokens.append(tree.tokens[path])
            features.append(torch.randn(len(path), len(target.feature_layers), target.model.config.hidden_size,
                                        generator=g))
        for d, t, f in zip(singles, tokens, features):
            d.commit(t, f)
        batch.commit(tokens, features)
        roots = [int(torch.randint(3, 96, (1,), generator=g)) for _ in prompts]


def test_rows_dropped_from_the_batch_leave_the_others_untouched(qwen):
    target, head = qwen
    prompts = _prompts(seed=2)
    singles, batch = _pair(target, head, prompts)
    budget, greedy = TreeBudget(20, 4, 4), SamplingConfig()
    roots = [int(p[-1]) for p in prompts]
    first = batch.propose(roots, budget, [4, 4, 4], greedy)
    tokens = [tree.tokens[path_to(tree, len(tree) - 1)] for tree in first]
    features = [_features(target, t) for t in tokens]
    for d, t, f in zip(singles, tokens, features):
        d.propose(int(t[0]), budget, greedy)
        d.commit(t, f)
    batch.commit(tokens, features)
    batch.keep_rows([2, 0])
    roots = [5, 9]
    _assert_same_trees(batch.propose(roots, budget, [4, 4], greedy),
                       [singles[2].propose(5, budget, greedy), singles[0].propose(9, budget, greedy)])


def test_all_rows_share_one_head_forward_per_depth(qwen):
    target, head = qwen
    _, batch = _pair(target, head, _prompts())
    before = batch.rows_drafted
    batch.propose([4, 5, 6], TreeBudget(60, 5, 10), [5, 5, 5], SamplingConfig())
    # depths 2..5 each expand at most `branching` nodes per row, padded to the widest row
    assert 0 < batch.rows_drafted - before <= 4 * 10 * len(LENGTHS)


def test_a_batch_drafter_needs_begin(qwen):
    target, head = qwen
    with pytest.raises(RuntimeError, match="before begin"):
        EagleBatchDrafter(head, target, 2).propose([1, 2], TreeBudget(4, 2, 2), [2, 2], SamplingConfig())


BATCH_ROWS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [11, 12, 13], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 3], [7, 7]]


@pytest.mark.parametrize("arch", ALL_ARCHITECTURES)
def test_batched_eagle_decoding_equals_each_row_decoded_alone(arch):
    model = tiny_model(arch)
    target = TargetModel(model)
    width = max(len(r) for r in BATCH_ROWS)
    ids = torch.tensor([[0] * (width - len(r)) + r for r in BATCH_ROWS])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in BATCH_ROWS])
    drafter = EagleDrafter(random_eagle_head(target, DRAFT_VOCAB), target, TreeBudget(12, 4, 3))
    result = SpecDecoder(target, drafter=drafter).generate(ids, attention_mask=mask, max_new_tokens=12)
    for row, prompt in enumerate(BATCH_ROWS):
        alone = hf_greedy(model, prompt, 12)[0, len(prompt):].tolist()
        assert result.sequences[row, width:].tolist()[: len(alone)] == alone, f"{arch} row {row}"
    assert any(step.tree_size > 0 for step in result.stats.steps)


def test_a_one_token_prompt_beside_longer_ones(qwen):
    """A row whose prompt has no committed pair yet (the engine's root is its only other token)."""
    target, head = qwen
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 96, (n,), generator=g) for n in (2, 9)]
    singles, batch = _pair(target, head, prompts)
    budget, greedy = TreeBudget(10, 3, 3), SamplingConfig()
    roots = [int(p[-1]) for p in prompts]
    _assert_same_trees(batch.propose(roots, budget, [3, 3], greedy), [d.propose(r, budget, greedy) for d, r in zip(singles, roots)])
