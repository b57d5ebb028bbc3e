"""A training-free drafter: prompt lookup / n-gram matching that proposes a *tree*.

The suffix of the sequence (the last n tokens, n from `max_ngram` down to `min_ngram`) is
looked up in the earlier context; the continuations after the most recent matches are merged
into a trie rooted at the pending token, so several guesses share their common prefixes.
A node's score is the log of the share of continuations passing through it, and the budget keeps
the best-scored `max_nodes` (ties: the more recent match), so a smaller budget keeps the best of a
larger one's nodes, as every drafter here does (`moe_spec.core.drafting.Drafter`).
"""

from __future__ import annotations

import math

import torch

from moe_spec.core.drafting import TreeBudget
from moe_spec.core.sampling import SamplingConfig
from moe_spec.core.tree import DraftTree


class LookupDrafter:
    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_matches: int = 8, budget: TreeBudget | None = None):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.max_matches = max_matches
        self.default_budget = budget or TreeBudget(max_nodes=16, max_depth=8, branching=4)
        self._history: list[int] = []

    def spawn(self) -> "LookupDrafter":
        """A fresh drafter with the same settings, for another sequence of a batch."""
        return LookupDrafter(self.max_ngram, self.min_ngram, self.max_matches, self.default_budget)

    def begin(self, prompt: torch.Tensor, features: torch.Tensor) -> None:
        self._history = prompt.tolist()

    def commit(self, tokens: torch.Tensor, features: torch.Tensor) -> None:
        self._history.extend(tokens.tolist())

    def propose(self, root_token: int, budget: TreeBudget, sampling: SamplingConfig) -> DraftTree:
        sequence = self._history + [root_token]
        continuations = self._continuations(sequence, budget.max_depth)
        return _merge_into_tree(root_token, continuations, budget)

    def _continuations(self, sequence: list[int], depth: int) -> list[list[int]]:
        if depth == 0 or len(sequence) < 2:
            return []
        seq = torch.tensor(sequence, dtype=torch.long)
        found: list[list[int]] = []
        seen: set[tuple[int, ...]] = set()
        for n in range(min(self.max_ngram, len(sequence) - 1), self.min_ngram - 1, -1):
            windows = seq[:-1].unfold(0, n, 1)  # [len-n, n]: every earlier n-gram (not the suffix itself)
            hits = (windows == seq[-n:]).all(dim=1).nonzero().flatten().flip(0)  # most recent first
            for start in hits.tolist():
                follow = tuple(sequence[start + n : start + n + depth])
                if follow and follow not in seen:
                    seen.add(follow)
                    found.append(list(follow))
                if len(found) >= self.max_matches:
                    return found
        return found


def _merge_into_tree(root_token: int, continuations: list[list[int]], budget: TreeBudget) -> DraftTree:
    tokens, parents, counts = [root_token], [-1], [len(continuations)]
    child_of: dict[tuple[int, int], int] = {}
    children = [0]  # per node: children so far (at most `budget.branching`)
    for continuation in continuations:
        node = 0
        for token in continuation:
            child = child_of.get((node, token))
            if child is None:
                if children[node] >= budget.branching:
                    break
                children[node] += 1
                child = len(tokens)
                child_of[(node, token)] = child
                tokens.append(token)
                parents.append(node)
                counts.append(0)
                children.append(0)
            counts[child] += 1
            node = child
    total = max(counts[0], 1)
    scores = [0.0] + [math.log(c / total) for c in counts[1:]]
    tree = DraftTree.from_lists(tokens, parents, scores)
    if len(tokens) - 1 <= budget.max_nodes:
        return tree
    # a child's share never exceeds its parent's and ties go to the lower (earlier) index, so the
    # best-scored set is closed under parents
    best = sorted(range(1, len(tokens)), key=lambda i: (-scores[i], i))[: budget.max_nodes]
    return tree.subtree([0] + best)
