"""The controller protocol: how large a candidate tree to draft, and which part of it to verify."""

from __future__ import annotations

from typing import Protocol

from moe_spec.acceptance import Acceptance
from moe_spec.drafters.base import TreeBudget
from moe_spec.routing import Routing
from moe_spec.tree import DraftTree


class Controller(Protocol):
    def reset(self) -> None:
        """Called at the start of every `generate`."""

    def candidate_budget(self, default: TreeBudget) -> TreeBudget:
        """The budget the drafter expands its candidate tree to."""

    def select(self, candidates: DraftTree, draft_ms: float) -> DraftTree:
        """The subtree to verify: connected, containing the root (root alone: a plain AR step).
        draft_ms: what drafting the candidates cost (already spent)."""

    def feedback(
        self, verified: DraftTree, acceptance: Acceptance, verify_ms: float, draft_ms: float, routing: Routing
    ) -> None:
        """What the target accepted and what the step cost."""


class StaticController:
    """A fixed node budget: verify the `max_nodes` best-scored nodes of the drafter's tree."""

    def __init__(self, budget: TreeBudget):
        self.budget = budget

    def reset(self) -> None:
        pass

    def candidate_budget(self, default: TreeBudget) -> TreeBudget:
        return self.budget

    name = "static"

    def select(self, candidates: DraftTree, draft_ms: float = 0.0) -> DraftTree:
        if candidates.num_drafted <= self.budget.max_nodes:
            return candidates
        # a node's cumulative score never exceeds its parent's, so the best-scored set is connected;
        # ties are broken towards lower (earlier, shallower) indices to keep it so.
        order = sorted(range(1, len(candidates)), key=lambda i: (-float(candidates.scores[i]), i))
        return candidates.subtree([0] + order[: self.budget.max_nodes])

    def feedback(self, verified, acceptance, verify_ms, draft_ms, routing) -> None:
        pass
