"""Acceptance on random trees: greedy against a reference walk written here, sampled against the
exact law of the first two emitted tokens (chi-square, fixed seeds), for both candidate schemes."""

from __future__ import annotations

import torch
from hypothesis import given, strategies as st

from moe_spec.core.acceptance import accept, accept_greedy, accept_sampled, conditional_acceptance
from moe_spec.core.sampling import SamplingConfig, probabilities
from moe_spec.core.tree import DraftTree, path_to
from moe_spec.testing.helpers import assert_follows
from tree_strategies import bounded, node_logits, trees

VOCAB = 4  # small: duplicate siblings and argmax hits are common
TRIALS = 1000


def reference_greedy(tokens: list[int], parents: list[int], logits: torch.Tensor) -> tuple[list[int], int]:
    """Walk from the root: step to the first child (lowest index) holding the target's argmax at the
    current node; stop where none does, the argmax there being the bonus token."""
    path = [0]
    while True:
        wanted = int(logits[path[-1]].argmax())
        match = [c for c in range(len(tokens)) if parents[c] == path[-1] and tokens[c] == wanted]
        if not match:
            return path, wanted
        path.append(match[0])


@bounded(300)
@given(st.data())
def test_greedy_acceptance_is_the_reference_walk(data):
    tree = data.draw(trees(vocab=VOCAB))
    logits = node_logits(data.draw, len(tree), VOCAB)
    path, bonus = reference_greedy(tree.tokens.tolist(), tree.parents.tolist(), logits)
    got = accept_greedy(tree, logits)
    assert (got.path, got.bonus_token) == (path, bonus)
    via_accept = accept(tree, logits, SamplingConfig(0.0))
    assert (via_accept.path, via_accept.bonus_token) == (path, bonus)
    assert got.path == path_to(tree, got.path[-1]), "the accepted nodes form a root path"
    assert got.new_tokens(tree) == tree.tokens[path[1:]].tolist() + [bonus]


configs = st.sampled_from([SamplingConfig(1.0), SamplingConfig(0.7), SamplingConfig(1.5, top_k=2),
                           SamplingConfig(1.0, top_p=0.8)])


def _second_position_logits(draw) -> tuple[torch.Tensor, torch.Tensor]:
    """Root logits [V] and, per first token a, the target's logits after it [V, V]."""
    return node_logits(draw, 1, VOCAB)[0], node_logits(draw, VOCAB, VOCAB)


def _exact_pair_law(root: torch.Tensor, after: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """[V, V] P(x1 = a, x2 = b) = p(a) p(b | a): what token-by-token sampling emits."""
    return probabilities(root, config)[:, None] * probabilities(after, config)


def _first_two(tree: DraftTree, logits: torch.Tensor, after: torch.Tensor, config, generator) -> tuple[int, int, list[int]]:
    """The step's first two tokens; when the step emits one (its bonus), the second is the next step's
    first, drawn from p(. | x1) as the engine's next step would."""
    acceptance = accept_sampled(tree, logits, config, generator)
    new = acceptance.new_tokens(tree)
    if len(new) == 1:
        new.append(int(torch.multinomial(probabilities(after[new[0]], config), 1, generator=generator)))
    return new[0], new[1], acceptance.path


@bounded(10, derandomize=True)
@given(st.data(), configs)
def test_sampled_deterministic_candidates_emit_the_targets_law(data, config):
    tree = data.draw(trees(max_nodes=10, vocab=VOCAB))
    root, after = _second_position_logits(data.draw)
    # node logits: the root's, and at a depth-1 node the target's after that node's token
    logits = node_logits(data.draw, len(tree), VOCAB)
    logits[0] = root
    first_level = (tree.parents == 0).nonzero().flatten().tolist()
    for node in first_level:
        logits[node] = after[int(tree.tokens[node])]
    generator = torch.Generator().manual_seed(len(tree) * 7919 + VOCAB)
    pairs = torch.zeros(VOCAB, VOCAB)
    accepted_first = torch.zeros(len(first_level) + 1)  # which root child was accepted; last: none
    for _ in range(TRIALS):
        x1, x2, path = _first_two(tree, logits, after, config, generator)
        pairs[x1, x2] += 1
        accepted_first[first_level.index(path[1]) if len(path) > 1 else -1] += 1
    assert_follows(pairs, _exact_pair_law(root, after, config))
    if not first_level:
        return
    # the exact per-child acceptance chances the calibration learns from
    chances = conditional_acceptance(tree, logits, config)[first_level].float()
    exact = torch.cat([chances, (1 - chances.sum()).clamp(min=0)[None]])
    assert_follows(accepted_first, exact)


def _draw_without_replacement(q: torch.Tensor, k: int, generator) -> list[int]:
    """k tokens from q [V], each from q with the earlier draws removed and renormalised."""
    q, drawn = q.clone(), []
    for _ in range(k):
        x = int(torch.multinomial(q, 1, generator=generator))
        drawn.append(x)
        q[x] = 0.0
        q = q / q.sum()
    return drawn


def _sampled_tree(root_token: int, q_root: torch.Tensor, q_after: torch.Tensor, k1: int, k2: int,
                  generator) -> DraftTree:
    """Two levels drawn from the proposals: k1 children of the root from q_root, then k2 children of
    each from q_after[its token]; node order root, level 1, level 2 (topological)."""
    tokens, parents, ranks, rows = [root_token], [-1], [0], [q_root]
    level_one = _draw_without_replacement(q_root, k1, generator)
    for rank, token in enumerate(level_one):
        tokens.append(token), parents.append(0), ranks.append(rank), rows.append(q_after[token])
    for parent, token in enumerate(level_one, start=1):
        for rank, child in enumerate(_draw_without_replacement(q_after[token], k2, generator)):
            uniform = torch.full((q_root.numel(),), 1.0 / q_root.numel())
            tokens.append(child), parents.append(parent), ranks.append(rank), rows.append(uniform)
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.zeros(len(tokens)), torch.stack(rows),
                     torch.arange(q_root.numel()), torch.tensor(ranks))


@bounded(8, derandomize=True)
@given(st.data(), configs, st.integers(1, VOCAB - 1), st.integers(0, 2))
def test_sampled_proposal_candidates_emit_the_targets_law(data, config, k1, k2):
    root, after = _second_position_logits(data.draw)
    q_root = node_logits(data.draw, 1, VOCAB)[0].softmax(-1)
    q_after = node_logits(data.draw, VOCAB, VOCAB).softmax(-1)
    generator = torch.Generator().manual_seed(k1 * 31 + k2)
    pairs = torch.zeros(VOCAB, VOCAB)
    for _ in range(TRIALS):
        tree = _sampled_tree(0, q_root, q_after, k1, k2, generator)  # the candidates are drawn anew each step
        logits = torch.stack([root] + [after[t] for t in tree.tokens[1:].tolist()])  # deeper rows unused
        x1, x2, _ = _first_two(tree, logits, after, config, generator)
        pairs[x1, x2] += 1
    assert_follows(pairs, _exact_pair_law(root, after, config))
