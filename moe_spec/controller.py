"""The controller protocol: how large a candidate tree to draft, and which part of it to verify.

Controllers see every row of a batch at once, because the rows share one verify pass: a row's
node is cheap when its experts are loaded for another row anyway. With one prompt the lists
have one entry.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from moe_spec.acceptance import Acceptance
from moe_spec.drafters.base import TreeBudget
from moe_spec.routing import Routing
from moe_spec.tree import DraftTree


class Controller(Protocol):
    def reset(self) -> None:
        """Called at the start of every `generate`."""

    def candidate_budget(self, default: TreeBudget) -> TreeBudget:
        """The budget the drafter expands its candidate trees to."""

    def select(self, candidates: Sequence[DraftTree], draft_ms: float) -> list[DraftTree]:
        """Per row, the subtree to verify: connected, containing the root (root alone: a plain AR
        step). draft_ms: what drafting the candidates cost (already spent)."""

    def feedback(
        self,
        verified: Sequence[DraftTree],
        acceptances: Sequence[Acceptance],
        verify_ms: float,
        draft_ms: float,
        routing: Sequence[Routing],
    ) -> None:
        """What the target accepted per row, and what the shared step cost."""


class StaticController:
    """A fixed node budget per row: verify the `max_nodes` best-scored nodes of each candidate tree."""

    name = "static"

    def __init__(self, budget: TreeBudget):
        self.budget = budget

    def reset(self) -> None:
        pass

    def candidate_budget(self, default: TreeBudget) -> TreeBudget:
        return self.budget

    def select(self, candidates: Sequence[DraftTree], draft_ms: float = 0.0) -> list[DraftTree]:
        return [self._select_one(tree) for tree in candidates]

    def _select_one(self, candidates: DraftTree) -> DraftTree:
        if candidates.num_drafted <= self.budget.max_nodes:
            return candidates
        # a node's cumulative score never exceeds its parent's, so the best-scored set is connected;
        # ties are broken towards lower (earlier, shallower) indices to keep it so.
        order = sorted(range(1, len(candidates)), key=lambda i: (-float(candidates.scores[i]), i))
        return candidates.subtree([0] + order[: self.budget.max_nodes])

    def feedback(self, verified, acceptances, verify_ms, draft_ms, routing) -> None:
        pass
