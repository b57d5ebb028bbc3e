"""Deciding which drafted nodes the target accepts, for greedy and sampled decoding.

Terms, as in vLLM's rejection sampler:
- *accepted* tokens: drafted nodes on the path the target agrees with;
- *bonus* token: the one token the target itself contributes after the last accepted node
  (its argmax when greedy; when sampling, a draw from the residual distribution if a
  candidate was rejected, or from the target's distribution if the node had no children).
A step therefore always produces `len(accepted) + 1` tokens; mean accepted length as reported
by moe_spec includes the bonus token.

Sampling follows SpecInfer's multi-candidate speculative sampling (Miao et al., 2024) with
recursive rejection over siblings. Our drafters propose *deterministic* candidates (top
tokens of the draft, or n-gram continuations), i.e. point-mass proposals q_j = delta(x_j). With
those, the rule "accept x_j with probability min(1, p_j(x_j) / q_j(x_j))" becomes
"accept with probability p_j(x_j)", and the residual norm(max(p_j - q_j, 0)) becomes p_j with
x_j removed and renormalised. Each emitted token is then distributed exactly as the target's
p: P(emit x_j) = p(x_j) for candidates, and the residual covers the rest. The total chance of
accepting some child, sum_j p(x_j), is the most any scheme can reach for those candidates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_spec.core.sampling import SamplingConfig, probabilities, sample
from moe_spec.core.tree import DraftTree


@dataclass(frozen=True)
class Acceptance:
    path: list[int]  # node indices from the root to the last accepted node (root included)
    bonus_token: int

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
    """Recursive rejection over siblings with point-mass candidates (see module docstring).

    logits: [N, V] target logits at each tree node.
    """
    tokens = tree.tokens.tolist()
    children = _children_lists(tree)
    path = [0]
    while True:
        node = path[-1]
        p = probabilities(logits[node], config)  # [V]
        accepted_child = None
        for child in children[node]:
            x = tokens[child]
            p_x = float(p[x])
            if p_x > 0 and float(torch.rand((), generator=generator)) < p_x:
                accepted_child = child
                break
            # residual after rejecting the point mass at x: remove x, renormalise
            p = p.clone()
            p[x] = 0.0
            total = float(p.sum())
            if total <= 0:  # p was a point mass at x: x would have been accepted
                break
            p = p / total
        if accepted_child is None:
            return Acceptance(path, sample(p, generator))
        path.append(accepted_child)


def accept(
    tree: DraftTree, logits: torch.Tensor, config: SamplingConfig, generator: torch.Generator | None = None
) -> Acceptance:
    if config.greedy:
        return accept_greedy(tree, logits)
    return accept_sampled(tree, logits, config, generator)
