"""EagleDrafter / EagleHead on tiny random targets: trees, cache handling, train/draft consistency,
loading, and a batch whose rows each get the tree they get alone (a single sequence is a batch of one)."""

from __future__ import annotations

import pytest
import torch

from moe_spec.core.drafting import EAGLE2_BUDGET, TreeBudget
from moe_spec.core.engine import SpecDecoder
from moe_spec.core.sampling import SamplingConfig
from moe_spec.core.target import TargetModel
from moe_spec.core.tree import DraftTree, path_to
from moe_spec.drafters.eagle import EagleDrafter
from moe_spec.drafters.eagle_head import DraftHeadMismatchError, EagleHead
from moe_spec.errors import MoeSpecError
from moe_spec.testing.helpers import (ALL_ARCHITECTURES, begun_eagle_drafter, hf_greedy, random_eagle_head,
                                     random_prompt, target_features)
from moe_spec.testing.tiny_models import tiny_model

torch.set_num_threads(1)
DRAFT_VOCAB = 64


_prompt, _features, _begun = random_prompt, target_features, begun_eagle_drafter


def _propose(drafter: EagleDrafter, root: int, budget: TreeBudget, sampling: SamplingConfig) -> DraftTree:
    """The tree of a one-row drafter."""
    return drafter.propose([root], budget, [budget.max_depth], sampling)[0]


def _check_tree(tree, root: int, budget: TreeBudget, head: EagleHead, vocab: int) -> None:
    assert int(tree.tokens[0]) == root and int(tree.parents[0]) == -1
    assert tree.num_drafted <= budget.max_nodes
    assert int(tree.depths.max()) <= budget.max_depth
    parents = tree.parents[1:]
    assert bool((parents < torch.arange(1, len(tree))).all())  # topological, connected
    assert bool((tree.scores[1:] <= tree.scores[parents] + 1e-6).all())  # non-increasing along paths
    assert bool(torch.isfinite(tree.scores).all())
    drafted = tree.tokens[1:]
    assert bool(((drafted >= 0) & (drafted < vocab)).all())
    assert bool(torch.isin(drafted, head.draft_to_target).all())
    for node in range(len(tree)):  # siblings are distinct tokens, at most `branching` of them
        children = tree.tokens[tree.parents == node]
        assert children.numel() <= budget.branching and children.unique().numel() == children.numel()


@pytest.mark.parametrize("budget", [TreeBudget(60, 5, 10), TreeBudget(7, 3, 4), TreeBudget(1, 1, 1), TreeBudget(5, 8, 2)])
@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(1.0), SamplingConfig(0.7, top_k=5, top_p=0.9)])
def test_tree_invariants(qwen, budget, sampling):
    target, head = qwen
    prompt = _prompt()
    tree = _propose(_begun(target, head, prompt), int(prompt[-1]), budget, sampling)
    _check_tree(tree, int(prompt[-1]), budget, head, target.vocab_size)
    assert tree.num_drafted == min(budget.max_nodes, _candidates(budget)) or not sampling.greedy


def _candidates(budget: TreeBudget) -> int:
    depth = min(budget.max_depth, budget.max_nodes)
    return budget.branching + (depth - 1) * budget.branching**2


def test_small_budget_keeps_the_globally_best_nodes(qwen):
    target, head = qwen
    prompt = _prompt()
    drafter = _begun(target, head, prompt)
    big = _propose(drafter, int(prompt[-1]), TreeBudget(60, 4, 6), SamplingConfig())
    small = _propose(drafter, int(prompt[-1]), TreeBudget(12, 4, 6), SamplingConfig())
    assert torch.allclose(small.scores[1:].sort(descending=True).values, big.scores[1:].sort(descending=True).values[:12])
    assert small.num_drafted == 12


def test_sampling_scores_follow_the_sampled_distribution(qwen):
    target, head = qwen
    prompt = _prompt()
    tree = _propose(_begun(target, head, prompt), int(prompt[-1]), TreeBudget(60, 3, 10), SamplingConfig(1.0, top_k=3))
    root_children = tree.scores[tree.parents == 0]
    assert root_children.numel() == 3  # tokens outside the top-3 have zero draft probability
    assert torch.logsumexp(root_children, 0).abs() < 1e-4  # they carry the whole sampled distribution


def test_incremental_drafting_equals_drafting_from_scratch(qwen):
    """The head's cache after several propose/commit rounds holds exactly the committed pairs."""
    target, head = qwen
    drafter = EagleDrafter(head, target)
    prompt = _prompt(10, seed=1)
    out = SpecDecoder(target, drafter=drafter).generate(prompt[None], max_new_tokens=24, eos_token_id=[])
    sequence = out.sequences[0]
    budget = TreeBudget(20, 4, 4)
    continued = _propose(drafter, int(sequence[-1]), budget, SamplingConfig())
    fresh = _propose(_begun(target, head, sequence), int(sequence[-1]), budget, SamplingConfig())
    assert torch.equal(continued.tokens, fresh.tokens) and torch.equal(continued.parents, fresh.parents)
    assert torch.allclose(continued.scores, fresh.scores, atol=1e-4)


def test_chain_drafts_follow_the_training_unroll(qwen):
    """Depth k+1 of a draft is pass k of `EagleHead.unroll` (the training-time test) on the same tokens."""
    target, head = qwen
    prompt = _prompt(9, seed=2)
    chain = _propose(_begun(target, head, prompt), int(prompt[-1]), TreeBudget(3, 3, 1), SamplingConfig())
    assert chain.num_drafted == 3 and chain.depths.tolist() == [0, 1, 2, 3]
    tokens = torch.cat([prompt, chain.tokens[1:]])  # prompt (root last) + drafts
    with torch.no_grad():
        features = _features(target, prompt[:-1])  # [P-1, S, D]
        features = torch.cat([features, torch.zeros(4, *features.shape[1:])])  # unknown past the root: unused
        embeds = target.model.get_input_embeddings()(tokens)
        passes = [head.logits(h[0]) for h in head.unroll(features[None], embeds[None], steps=3)]
    root_pair = len(prompt) - 2  # pair (features of the last committed position, root)
    cumulative = 0.0
    for k, logits in enumerate(passes):
        logp = torch.log_softmax(logits[root_pair + k], -1)
        assert int(head.draft_to_target[logp.argmax()]) == int(chain.tokens[k + 1])
        cumulative += float(logp.max())
        assert abs(cumulative - float(chain.scores[k + 1])) < 1e-4


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss", "deepseek_v3", "mixtral"])
def test_greedy_matches_generate_with_a_random_head(model_type):
    model = tiny_model(model_type)
    target = TargetModel(model)
    prompt = _prompt(11, seed=3)[None]
    out = SpecDecoder(target, drafter=EagleDrafter(random_eagle_head(target, DRAFT_VOCAB), target)).generate(
        prompt, max_new_tokens=30, eos_token_id=[])
    reference = model.generate(prompt, do_sample=False, max_new_tokens=30, min_new_tokens=30, eos_token_id=[],
                               pad_token_id=0)
    assert torch.equal(out.sequences, reference)
    assert all(step.tree_size <= 60 for step in out.stats.steps)


def test_save_and_reload_round_trip(qwen, tmp_path):
    target, head = qwen
    EagleDrafter(head, target).save_pretrained(tmp_path)
    loaded = EagleDrafter.from_pretrained(tmp_path, target)
    assert loaded.head.config == head.config
    assert torch.equal(loaded.head.draft_to_target, head.draft_to_target)
    assert torch.equal(loaded.head.fc.weight, head.fc.weight.to(torch.bfloat16).float())
    assert loaded.default_budget == TreeBudget(60, 5, 10)


@pytest.mark.parametrize(
    "other, named",
    [
        (dict(vocab_size=128), "vocab_size"),
        (dict(hidden_size=64, head_dim=16), "target_hidden_size"),
        (dict(num_hidden_layers=1), "aux layers"),
    ],
)
def test_loading_against_another_target_names_the_mismatch(qwen, tmp_path, other, named):
    target, head = qwen
    head.save_pretrained(tmp_path)
    other_target = TargetModel(tiny_model("qwen3_moe", **other))
    with pytest.raises(DraftHeadMismatchError, match=named) as info:
        EagleDrafter.from_pretrained(tmp_path, other_target)
    assert isinstance(info.value, MoeSpecError)


def test_the_target_captures_the_layers_the_head_fuses(qwen):
    """A head names the target layers it reads (or takes EAGLE's default); its drafter makes the target
    capture those, whatever it captured before."""
    target, head = qwen
    other = TargetModel(target.model, feature_layers=(1, 2))
    EagleDrafter(head, other)
    assert other.feature_layers == head.config.feature_layers_for(other.num_layers) == (0, 1, 2)


def test_loading_a_folder_without_a_head_is_a_clear_error(qwen, tmp_path):
    with pytest.raises(MoeSpecError, match="config.json"):
        EagleDrafter.from_pretrained(tmp_path, qwen[0])


def _expanded_rows(drafter: EagleDrafter, calls: list) -> None:
    """Record the rows per batch row of every tree forward (one per expanded depth; g is [B, M, D])."""
    draft = drafter._runner.draft

    def counting(g, *args, **kwargs):
        calls.append(g.shape[1])
        return draft(g, *args, **kwargs)

    drafter._runner.draft = counting


@pytest.mark.parametrize("branching", [10, 3])
def test_smaller_budgets_expand_fewer_nodes_and_keep_the_globally_best(qwen, branching):
    """A budget of K nodes expands at most min(branching, K) nodes per depth, stops once no frontier node
    can enter the top K, and still returns exactly the top K of the unpruned tree (closed under parents)."""
    target, head = qwen
    prompt = _prompt(seed=4)
    drafter = _begun(target, head, prompt)
    root, depth = int(prompt[-1]), 5
    everything = _propose(drafter, root, TreeBudget(10**6, depth, branching), SamplingConfig())  # never pruned
    full_rows = drafter.rows_drafted
    assert everything.num_drafted == _candidates(TreeBudget(10**6, depth, branching))
    assert full_rows == (depth - 1) * branching
    rows = {}
    for k in (1, 2, 4, 8, 16, 32, 60):
        calls = []
        _expanded_rows(drafter, calls)
        before = drafter.rows_drafted
        tree = _propose(drafter, root, TreeBudget(k, depth, branching), SamplingConfig())
        rows[k] = drafter.rows_drafted - before
        assert rows[k] == sum(calls) and all(m <= min(branching, k) for m in calls)
        best = torch.sort(everything.scores[1:], descending=True, stable=True).indices[:k] + 1
        reference = everything.subtree(torch.cat([torch.tensor([0]), best]))
        assert torch.equal(tree.tokens, reference.tokens) and torch.equal(tree.parents, reference.parents)
        assert torch.allclose(tree.scores, reference.scores, atol=1e-5)
    assert rows[1] == 0 and rows[2] <= 2  # one node: no forward past the root; two: a chain at most
    assert all(rows[a] <= rows[b] for a, b in zip((1, 2, 4, 8, 16, 32), (2, 4, 8, 16, 32, 60)))
    assert rows[8] < full_rows


def test_the_drafter_follows_changes_to_the_head_weights(qwen):
    """The runner's fused weights are copies; training (in-place updates) must not leave them stale."""
    target, _ = qwen
    head = random_eagle_head(target, DRAFT_VOCAB, seed=6)
    prompt = _prompt(seed=6)
    drafter = _begun(target, head, prompt)
    before = _propose(drafter, int(prompt[-1]), TreeBudget(10, 3, 3), SamplingConfig())
    with torch.no_grad():
        head.layers[0].mlp.gate_proj.weight.mul_(-1.0)
        head.layers[0].self_attn.q_proj.weight.mul_(3.0)
    changed = _propose(drafter, int(prompt[-1]), TreeBudget(10, 3, 3), SamplingConfig())
    fresh = _propose(_begun(target, head, prompt), int(prompt[-1]), TreeBudget(10, 3, 3), SamplingConfig())
    assert torch.equal(changed.tokens, fresh.tokens) and torch.allclose(changed.scores, fresh.scores, atol=1e-5)
    assert not torch.allclose(before.scores, changed.scores)


def test_begin_starts_over_for_any_batch_size(qwen):
    """One drafter serves every generate call: begin drops the previous rows, whatever their number."""
    target, head = qwen
    prompts = [_prompt(n, seed=7 + n) for n in (6, 11, 9)]
    drafter = _begun(target, head, *prompts)
    drafter.propose([int(p[-1]) for p in prompts], TreeBudget(10, 3, 3), [3, 3, 3], SamplingConfig())
    drafter.begin([prompts[1][:-1]], [_features(target, prompts[1][:-1])])
    again = _propose(drafter, int(prompts[1][-1]), TreeBudget(10, 3, 3), SamplingConfig())
    fresh = _propose(_begun(target, head, prompts[1]), int(prompts[1][-1]), TreeBudget(10, 3, 3), SamplingConfig())
    assert torch.equal(again.tokens, fresh.tokens) and torch.equal(again.parents, fresh.parents)


def test_a_drafter_needs_begin(qwen):
    target, head = qwen
    with pytest.raises(RuntimeError, match="before begin"):
        EagleDrafter(head, target).propose([1, 2], TreeBudget(4, 2, 2), [2, 2], SamplingConfig())


def _reference_tree(target: TargetModel, head: EagleHead, prompt: torch.Tensor, budget: TreeBudget,
                    sampling: SamplingConfig):
    """The drafter before its fast path, kept as an oracle: EAGLE-2 grown through `EagleHead.forward` and a
    DynamicCache with per-node bookkeeping, every candidate drafted (no pruning), then reranked."""
    from transformers import DynamicCache

    from moe_spec.drafters.eagle_head import additive_mask
    from moe_spec.core.sampling import probabilities
    from moe_spec.core.tree import DraftTree

    embed = target.model.get_input_embeddings()
    features = _features(target, prompt[:-1])  # [P-1, S, D]
    g, pair_tokens = head.fuse(features), prompt[1:]  # pairs (position t, token t+1); the last is the root pair
    n = pair_tokens.numel()
    cache = DynamicCache()

    def forward(g, tokens, visible, positions):
        mask = additive_mask(visible[None], torch.float32)
        return head(g[None], embed(tokens)[None], mask, positions[None], cache)[0]

    def log_probs(h):
        logits = head.logits(h).float()
        return torch.log_softmax(logits, -1) if sampling.greedy else probabilities(logits, sampling).log()

    h_root = forward(g, pair_tokens, torch.tril(torch.ones(n, n, dtype=torch.bool)), torch.arange(n))[-1]
    committed, width = n - 1, budget.branching
    tokens, parents, scores = [torch.tensor([-1])], [torch.tensor([-1])], [torch.zeros(1)]
    h_of, seen = {0: h_root}, {0: torch.zeros(committed + 1, dtype=torch.bool)}
    seen[0][committed] = True

    def add_children(nodes, h, node_scores):
        top_logp, top_ids = log_probs(h).topk(width, dim=-1)
        cumulative = (node_scores[nodes][:, None] + top_logp).flatten()
        keep = cumulative > float("-inf")
        first = sum(t.numel() for t in tokens)
        tokens.append(top_ids.flatten()[keep])
        parents.append(nodes[:, None].expand(-1, width).flatten()[keep])
        scores.append(cumulative[keep])
        return torch.arange(first, first + int(keep.sum())), scores[-1]

    frontier, frontier_scores = add_children(torch.tensor([0]), h_root[None], torch.zeros(1))
    for depth in range(2, min(budget.max_depth, budget.max_nodes) + 1):
        all_parents, all_tokens = torch.cat(parents), torch.cat(tokens)
        order = frontier[torch.sort(frontier_scores, descending=True, stable=True).indices[:width]]
        length, m = cache.get_seq_length(), order.numel()
        visible = torch.zeros(m, length + m, dtype=torch.bool)
        visible[:, :committed] = True
        for row, node in enumerate(order.tolist()):
            parent_seen = seen[int(all_parents[node])]
            visible[row, : parent_seen.numel()] |= parent_seen
            visible[row, length + row] = True
            seen[node] = visible[row].clone()
        g_rows = torch.stack([h_of[int(p)] for p in all_parents[order]])
        h = forward(g_rows, head.draft_to_target[all_tokens[order]], visible, torch.full((m,), committed + depth - 1))
        h_of.update(zip(order.tolist(), h))
        frontier, frontier_scores = add_children(order, h, torch.cat(scores))
    all_scores = torch.cat(scores)
    keep = torch.sort(all_scores[1:], descending=True, stable=True).indices[: budget.max_nodes] + 1
    ids = torch.cat(tokens)
    ids[1:] = head.draft_to_target[ids[1:]]
    ids[0] = int(prompt[-1])
    all_parents = torch.cat(parents)
    # each node's parent's h, as this forward computed it (every node's parent was expanded)
    parent_h = torch.stack([torch.zeros_like(h_root)] + [h_of[int(p)] for p in all_parents[1:]])
    return DraftTree(ids, all_parents, all_scores, node_features=parent_h).subtree(torch.cat([torch.tensor([0]), keep]))


@pytest.mark.parametrize("budget", [TreeBudget(60, 5, 10), TreeBudget(8, 5, 10), TreeBudget(16, 4, 6), TreeBudget(30, 6, 3)])
@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(1.0)])
def test_drafts_match_the_hf_forward_reference_for_a_saved_head(qwen, tmp_path, budget, sampling):
    """A head saved in the released format (bf16 weights) loads and drafts what the plain HF-module path
    drafts: same nodes, scores within 1e-5."""
    target, head = qwen
    head.save_pretrained(tmp_path)
    loaded = EagleHead.from_pretrained(tmp_path)
    prompt = _prompt(seed=8)
    tree = _propose(_begun(target, loaded, prompt), int(prompt[-1]), budget, sampling)
    with torch.no_grad():
        reference = _reference_tree(target, loaded, prompt, budget, sampling)
    assert torch.equal(tree.tokens, reference.tokens) and torch.equal(tree.parents, reference.parents)
    assert torch.allclose(tree.scores, reference.scores, atol=1e-5)


@pytest.mark.parametrize("budget", [TreeBudget(60, 5, 10), TreeBudget(8, 5, 10), TreeBudget(30, 6, 3), TreeBudget(1, 1, 1)])
@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(1.0)])
def test_node_features_are_the_parents_head_output(qwen, budget, sampling):
    """Asked for, every node carries the h its parent's head forward computed (the HF-module
    reference's, within float rounding), the root zeros; the tree is otherwise the same tree."""
    target, head = qwen
    prompt = _prompt(seed=8)
    asked = budget.with_node_features(True)
    tree = _propose(_begun(target, head, prompt), int(prompt[-1]), asked, sampling)
    with torch.no_grad():
        reference = _reference_tree(target, head, prompt, budget, sampling)
    assert torch.equal(tree.tokens, reference.tokens) and torch.equal(tree.parents, reference.parents)
    assert tree.node_features.shape == (len(tree), head.config.hidden_size)
    assert torch.count_nonzero(tree.node_features[0]) == 0
    assert torch.allclose(tree.node_features, reference.node_features, atol=1e-5)
    plain = _propose(_begun(target, head, prompt), int(prompt[-1]), budget, sampling)
    assert plain.node_features is None
    assert torch.equal(plain.tokens, tree.tokens) and torch.equal(plain.parents, tree.parents)
    assert torch.equal(plain.scores, tree.scores)


def test_sampled_trees_carry_node_features_with_their_proposals(qwen):
    target, head = qwen
    prompt = _prompt(seed=3)
    budget = TreeBudget(20, 4, 4, sampled=True)
    trees = [_begun(target, head, prompt).propose([int(prompt[-1])], b, [4], SamplingConfig(1.0),
                                                  torch.Generator().manual_seed(5))[0]
             for b in (budget, budget.with_node_features(True))]
    plain, featured = trees
    assert featured.sampled and featured.node_features is not None and plain.node_features is None
    for field in ("tokens", "parents", "scores", "proposals", "draw_rank"):
        assert torch.equal(getattr(plain, field), getattr(featured, field)), field
    kept = featured.subtree([0] + featured.children(0))
    assert torch.equal(kept.node_features, featured.node_features[[0] + featured.children(0)])


def test_greedy_decoding_is_unchanged_by_asking_for_node_features(qwen):
    from moe_spec.policy.static import StaticController

    target, head = qwen
    prompt = _prompt(10, seed=4)
    outputs = []
    for asked in (False, True):
        controller = StaticController(TreeBudget(16, 4, 4).with_node_features(asked))
        drafter = EagleDrafter(head, target)
        outputs.append(SpecDecoder(target, drafter, controller).generate(prompt[None], max_new_tokens=20,
                                                                         eos_token_id=[]).sequences)
    plain = SpecDecoder(target).generate(prompt[None], max_new_tokens=20, eos_token_id=[]).sequences
    assert torch.equal(outputs[0], plain) and torch.equal(outputs[1], plain)


# -- a batch: each row gets the tree it gets alone ---------------------------------------------------

LENGTHS = [12, 5, 20]


def _prompts(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (n,), generator=g) for n in LENGTHS]


def _batch_and_alone(target, head, prompts):
    """One drafter begun on all prompts, and one per prompt begun on it alone (each a batch of one)."""
    return _begun(target, head, *prompts), [_begun(target, head, p) for p in prompts]


def _assert_same_trees(batched, alone):
    for b, (mine, theirs) in enumerate(zip(batched, alone, strict=True)):
        assert torch.equal(mine.tokens, theirs.tokens), f"row {b}"
        assert torch.equal(mine.parents, theirs.parents), f"row {b}"
        assert torch.allclose(mine.scores, theirs.scores, atol=1e-4), f"row {b}"


def _alone(drafter: EagleDrafter, root: int, budget: TreeBudget, depth: int, sampling: SamplingConfig) -> DraftTree:
    return drafter.propose([root], budget, [depth], sampling)[0]


@pytest.mark.parametrize("budget", [TreeBudget(60, 5, 10), TreeBudget(7, 3, 4), TreeBudget(1, 1, 1), TreeBudget(12, 6, 3)])
@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(0.7, top_k=5, top_p=0.9)])
def test_each_rows_tree_is_the_tree_it_gets_alone_over_several_steps(qwen, budget, sampling):
    target, head = qwen
    prompts = _prompts()
    batch, singles = _batch_and_alone(target, head, prompts)
    roots = [int(p[-1]) for p in prompts]
    g = torch.Generator().manual_seed(1)
    for step, depths in enumerate([[5, 5, 5], [2, 0, 5], [1, 3, 0]]):
        batched = batch.propose(roots, budget, depths, sampling)
        alone = [_alone(d, r, budget, depth, sampling) for d, r, depth in zip(singles, roots, depths)]
        _assert_same_trees(batched, alone)
        for tree, depth in zip(batched, depths):  # a row's depth cap holds, 0 meaning the root alone
            assert int(tree.depths.max()) <= depth
        # accept a random path per row; the same committed tokens and features go to both
        tokens, features = [], []
        for tree in alone:
            node = int(torch.randint(len(tree), (1,), generator=g))
            path = path_to(tree, node)
            tokens.append(tree.tokens[path])
            features.append(torch.randn(len(path), len(target.feature_layers), target.model.config.hidden_size,
                                        generator=g))
        for d, t, f in zip(singles, tokens, features):
            d.commit([t], [f])
        batch.commit(tokens, features)
        roots = [int(torch.randint(3, 96, (1,), generator=g)) for _ in prompts]


def test_rows_dropped_from_the_batch_leave_the_others_untouched(qwen):
    target, head = qwen
    prompts = _prompts(seed=2)
    batch, singles = _batch_and_alone(target, head, prompts)
    budget, greedy = TreeBudget(20, 4, 4), SamplingConfig()
    roots = [int(p[-1]) for p in prompts]
    first = batch.propose(roots, budget, [4, 4, 4], greedy)
    tokens = [tree.tokens[path_to(tree, len(tree) - 1)] for tree in first]
    features = [_features(target, t) for t in tokens]
    for d, t, f in zip(singles, tokens, features):
        _propose(d, int(t[0]), budget, greedy)
        d.commit([t], [f])
    batch.commit(tokens, features)
    batch.keep_rows([2, 0])
    _assert_same_trees(batch.propose([5, 9], budget, [4, 4], greedy),
                       [_propose(singles[2], 5, budget, greedy), _propose(singles[0], 9, budget, greedy)])


def test_all_rows_share_one_head_forward_per_depth(qwen):
    target, head = qwen
    batch, _ = _batch_and_alone(target, head, _prompts())
    calls, before = [], batch.rows_drafted
    _expanded_rows(batch, calls)
    batch.propose([4, 5, 6], EAGLE2_BUDGET, [5, 5, 5], SamplingConfig())
    # depths 2..5 each expand at most `branching` nodes per row, padded to the widest row
    assert 0 < batch.rows_drafted - before <= 4 * 10 * len(LENGTHS)
    assert 0 < len(calls) <= 4 and all(m <= 10 for m in calls)


def test_each_rows_node_features_are_those_it_gets_alone(qwen):
    target, head = qwen
    prompts = _prompts(seed=5)
    batch, singles = _batch_and_alone(target, head, prompts)
    budget, greedy = TreeBudget(12, 4, 3, node_features=True), SamplingConfig()
    roots = [int(p[-1]) for p in prompts]
    batched = batch.propose(roots, budget, [4, 2, 4], greedy)
    alone = [_alone(d, r, budget, depth, greedy) for d, r, depth in zip(singles, roots, [4, 2, 4])]
    _assert_same_trees(batched, alone)
    for mine, theirs in zip(batched, alone, strict=True):
        assert mine.node_features.shape == theirs.node_features.shape
        assert torch.allclose(mine.node_features, theirs.node_features, atol=1e-5)


def test_a_one_token_prompt_beside_longer_ones(qwen):
    """A row whose prompt has no committed pair yet (the engine's root is its only other token)."""
    target, head = qwen
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 96, (n,), generator=g) for n in (2, 9)]
    batch, singles = _batch_and_alone(target, head, prompts)
    budget, greedy = TreeBudget(10, 3, 3), SamplingConfig()
    roots = [int(p[-1]) for p in prompts]
    _assert_same_trees(batch.propose(roots, budget, [3, 3], greedy), [_propose(d, r, budget, greedy) for d, r in zip(singles, roots)])


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


def test_the_prompt_is_taken_in_by_begin_not_by_the_first_draft(qwen):
    """`begin` writes every prompt pair into the head's cache, so the first step drafts as cheaply as
    any later one: its forward at depth 0 takes in one pair a row (the root's), not the prompt."""
    target, head = qwen
    prompts = [_prompt(n, seed=3 + n) for n in (6, 11, 9)]
    drafter = _begun(target, head, *prompts)
    assert drafter.rows_extended == sum(len(p) - 2 for p in prompts)  # begun on p[:-1]: its pairs
    drafter.propose([int(p[-1]) for p in prompts], TreeBudget(10, 3, 3), [3, 3, 3], SamplingConfig())
    assert drafter.rows_extended == sum(len(p) - 2 for p in prompts) + len(prompts)
