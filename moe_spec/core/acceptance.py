"""Deciding which drafted nodes the target accepts, for greedy and sampled decoding.

Terms, as in vLLM's rejection sampler:
- *accepted* tokens: drafted nodes on the path the target agrees with;
- *bonus* token: the one token the target itself contributes after the last accepted node
  (its argmax when greedy; when sampling, a draw from the residual distribution if a
  candidate was rejected, or from the target's distribution if the node had no children).
A step therefore always produces `len(accepted) + 1` tokens; mean accepted length as reported
by moe_spec includes the bonus token.

Sampling follows SpecInfer's multi-candidate speculative sampling (Miao et al., 2024) with
recursive rejection over siblings. At a node whose target distribution is p, the children
x_1..x_k are tried in order: x_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)); on
rejection p_{i+1} = norm(max(p_i - q_i, 0)) (the residual), and if every child is rejected the
bonus token is drawn from p_{k+1}. Whatever the proposals, each emitted token is distributed
exactly as p, provided x_i was drawn from q_i given everything before it, and the number of
children k does not depend on the values drawn for them.

Two schemes of candidates (`moe_spec.core.tree`):
- *deterministic* (top tokens of the draft, n-gram continuations): q_i = delta(x_i), so x_i is
  accepted with probability p_i(x_i) and the residual is p_i with x_i removed, renormalised;
  the chance of accepting some child, sum_j p(x_j), is the most any scheme gets from those
  candidates;
- *sampled* (drawn from the draft distribution q without replacement, as in Recursive
  Speculative Decoding, Jeon et al. 2024): q_1 = q and q_{i+1} is q_i with x_i removed,
  renormalised. One candidate is accepted with probability 1 - TV(p, q), far above p(x) where
  the target spreads its mass over tokens a good draft also likes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moe_spec.core.sampling import SamplingConfig, probabilities, sample
from moe_spec.core.tree import DraftTree


@dataclass(frozen=True)
class Acceptance:
    path: list[int]  # node indices from the root to the last accepted node (root included)
    bonus_token: int
    # sampled verification: (node, P(accepted | its turn came)) of each candidate tried, in order
    # (min(1, p(x) / q(x)) against the residual of its turn; for a chain, P(accepted | parent
    # reached) of every node up to the first rejected), what controllers learn acceptance from at
    # no extra cost; empty under greedy verification
    trials: tuple[tuple[int, float], ...] = field(default=(), compare=False)

    @property
    def num_accepted(self) -> int:
        """Drafted tokens accepted (the root is not a drafted token)."""
        return len(self.path) - 1

    def new_tokens(self, tree: DraftTree) -> list[int]:
        """Tokens this step appends to the sequence: accepted drafts, then the bonus."""
        return tree.tokens[self.path[1:]].tolist() + [self.bonus_token]


def _children_lists(tree: DraftTree) -> list[list[int]]:
    children: list[list[int]] = [[] for _ in range(len(tree))]
    for node, parent in enumerate(tree.parents.tolist()):
        if parent >= 0:
            children[parent].append(node)
    return children


def accept_greedy(tree: DraftTree, logits: torch.Tensor) -> Acceptance:
    """Longest root path whose every token equals the target's argmax at its parent.

    logits: [N, V] target logits at each tree node.
    """
    argmax = logits.argmax(-1).tolist()  # [N]
    tokens = tree.tokens.tolist()
    children = _children_lists(tree)
    path = [0]
    while True:
        node = path[-1]
        match = next((c for c in children[node] if tokens[c] == argmax[node]), None)
        if match is None:
            return Acceptance(path, argmax[node])
        path.append(match)


def accept_sampled(
    tree: DraftTree, logits: torch.Tensor, config: SamplingConfig, generator: torch.Generator | None
) -> Acceptance:
    """Recursive rejection over siblings (see module docstring), for either scheme of candidates.

    logits: [N, V] target logits at each tree node.
    """
    tokens = tree.tokens.tolist()
    children = _children_lists(tree)
    _check_draw_prefixes(tree, children)
    path = [0]
    trials: list[tuple[int, float]] = []
    while True:
        node = path[-1]
        p = probabilities(logits[node], config)  # [V]
        q = tree.proposal_at(node, p.shape[-1]) if tree.sampled and children[node] else None  # [V]
        accepted_child = None
        for child in children[node]:
            x = tokens[child]
            p_x = float(p[x])
            q_x = float(q[x]) if q is not None else 1.0
            trials.append((child, min(1.0, p_x / q_x) if q_x > 0 else 0.0))
            if p_x > 0 and float(torch.rand((), generator=generator)) * q_x < p_x:
                accepted_child = child
                break
            # None: p_i <= q_i everywhere, i.e. p_i == q_i up to rounding, where rejection has
            # probability 0; p_i stands in for its residual
            residual = _residual(p, q, x)
            p = residual if residual is not None else p
            if q is not None:
                q = _without(q, x)
        if accepted_child is None:
            return Acceptance(path, sample(p, generator), tuple(trials))
        path.append(accepted_child)


def conditional_acceptance(tree: DraftTree, logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """[N] float: P(node accepted | its parent reached), exactly, for the scheme the tree was drafted
    with (root 1). Greedy: 1 where the token is the target's argmax at the parent, else 0. Sampling:
    the chance recursive rejection reaches the node's turn among its siblings and accepts it, the
    label calibration learns from (a 0/1 outcome would carry the same mean with far more noise).

    logits: [N, V] target logits at each tree node.
    """
    out = torch.zeros(len(tree), dtype=torch.float64)
    out[0] = 1.0
    children = _children_lists(tree)
    tokens = tree.tokens.tolist()
    if config.greedy:
        argmax = logits.argmax(-1)
        labels = tree.tokens == argmax[tree.parents.clamp(min=0)]
        labels[0] = True
        return labels.double()
    _check_draw_prefixes(tree, children)
    for node, kids in enumerate(children):
        if not kids:
            continue
        p = probabilities(logits[node], config)
        q = tree.proposal_at(node, p.shape[-1]) if tree.sampled else None
        reach = 1.0  # P(this child's turn comes)
        for child in kids:
            x = tokens[child]
            q_x = float(q[x]) if q is not None else 1.0
            accept = min(1.0, float(p[x]) / q_x) if q_x > 0 else 0.0
            out[child] = reach * accept
            reach *= 1.0 - accept
            if reach <= 0.0:
                break
            p = _residual(p, q, x)
            if p is None:
                break
            if q is not None:
                q = _without(q, x)
    return out


def _residual(p: torch.Tensor, q: torch.Tensor | None, x: int) -> torch.Tensor | None:
    """norm(max(p - q, 0)) over [V], q a point mass at x when None; None if nothing is left."""
    if q is None:
        residual = p.clone()
        residual[x] = 0.0
    else:
        residual = (p - q).clamp_(min=0.0)
    total = float(residual.sum())
    return residual / total if total > 0 else None


def _without(q: torch.Tensor, x: int) -> torch.Tensor:
    """The proposal of the next draw without replacement: q with x removed, renormalised."""
    q = q.clone()
    q[x] = 0.0
    total = float(q.sum())
    return q / total if total > 0 else q


def _check_draw_prefixes(tree: DraftTree, children: list[list[int]]) -> None:
    """A sampled tree's children of every node must be its first draws, in draw order."""
    if not tree.sampled:
        return
    ranks = tree.draw_rank.tolist()
    for node, kids in enumerate(children):
        if [ranks[c] for c in kids] != list(range(len(kids))):
            raise ValueError(f"node {node}'s children are draws {[ranks[c] for c in kids]} of its proposal; "
                             f"verification needs its first draws in order (a cut may drop only later draws)")


def accept(
    tree: DraftTree, logits: torch.Tensor, config: SamplingConfig, generator: torch.Generator | None = None
) -> Acceptance:
    if config.greedy:
        return accept_greedy(tree, logits)
    return accept_sampled(tree, logits, config, generator)
