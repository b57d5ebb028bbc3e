"""`StaticController`: a fixed node budget per row (the `static:N` and `eagle2` methods)."""

from __future__ import annotations

from collections.abc import Sequence

from moe_spec.core.drafting import TreeBudget
from moe_spec.core.tree import DraftTree


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
