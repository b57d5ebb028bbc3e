"""Drafting for a batch: the protocol the engine talks to, and the adapter for per-row drafters.

The engine drafts every row of a batch in one call, so a drafter that can batch its own work
(`EagleDrafter.for_batch`: one head forward per tree depth for all rows) does; any other drafter
with `spawn()` runs one copy per row behind `PerRowDrafters`. A single prompt goes through
`PerRowDrafters` with the caller's drafter itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from moe_spec.drafters.base import Drafter, TreeBudget
from moe_spec.errors import InputError
from moe_spec.sampling import SamplingConfig
from moe_spec.tree import DraftTree


class BatchDrafter(Protocol):
    """`Drafter` for B rows at once; lists hold one entry per row of the current batch."""

    default_budget: TreeBudget

    def begin(self, prompts: Sequence[torch.Tensor], features: Sequence[torch.Tensor]) -> None:
        """prompts[b]: [T_b] long; features[b]: [T_b, S, D]."""

    def propose(self, roots: Sequence[int], budget: TreeBudget, max_depths: Sequence[int],
                sampling: SamplingConfig) -> list[DraftTree]:
        """Row b's tree rooted at roots[b], at most max_depths[b] deep (0: the root alone)."""

    def commit(self, tokens: Sequence[torch.Tensor], features: Sequence[torch.Tensor]) -> None:
        """tokens[b]: [A_b] long now in the target's cache; features[b]: [A_b, S, D]."""

    def keep_rows(self, rows: Sequence[int]) -> None:
        """Drop every row not listed (finished rows leave the batch); the order is kept."""


class PerRowDrafters:
    """One `Drafter` per row, called row by row."""

    def __init__(self, drafters: Sequence[Drafter]):
        self.drafters = list(drafters)
        self.default_budget = self.drafters[0].default_budget

    def begin(self, prompts, features) -> None:
        for drafter, prompt, feature in zip(self.drafters, prompts, features):
            drafter.begin(prompt, feature)

    def propose(self, roots, budget, max_depths, sampling) -> list[DraftTree]:
        return [
            drafter.propose(root, budget.capped(depth), sampling) if depth > 0 else DraftTree.root_only(root)
            for drafter, root, depth in zip(self.drafters, roots, max_depths)
        ]

    def commit(self, tokens, features) -> None:
        for drafter, token, feature in zip(self.drafters, tokens, features):
            drafter.commit(token, feature)

    def keep_rows(self, rows) -> None:
        self.drafters = [self.drafters[i] for i in rows]


def batch_drafter(drafter: Drafter, batch: int) -> BatchDrafter:
    """The drafter for `batch` rows: its own batched form if it has one, else copies of it per row."""
    if batch > 1 and hasattr(drafter, "for_batch"):
        return drafter.for_batch(batch)
    if batch == 1:
        return PerRowDrafters([drafter])
    spawn = getattr(drafter, "spawn", None)
    if spawn is None:
        raise InputError(f"{type(drafter).__name__} cannot draft for a batch (it has no spawn()); pass one prompt")
    return PerRowDrafters([drafter] + [spawn() for _ in range(batch - 1)])
