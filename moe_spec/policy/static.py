"""`StaticController`: a fixed node budget per row (the `static:N` and `eagle2` methods)."""

from __future__ import annotations

from moe_spec.core.control import StepPlan
from moe_spec.core.drafting import TreeBudget
from moe_spec.core.forest import StepForest
from moe_spec.core.sampling import GREEDY, SamplingConfig
from moe_spec.core.step_record import StepRecord
from moe_spec.core.tree import DraftTree


class StaticController:
    """Draft to `budget` every step and verify each row's `budget.max_nodes` best-scored nodes."""

    name = "static"

    def __init__(self, budget: TreeBudget):
        self.budget = budget

    def begin(self, default: TreeBudget, sampling: SamplingConfig = GREEDY) -> TreeBudget:
        return self.budget

    def plan(self, candidates: StepForest, draft_ms: float = 0.0) -> StepPlan:
        return StepPlan(StepForest(tuple(self._select_one(tree) for tree in candidates)), self.budget)

    def observe(self, record: StepRecord) -> None:
        pass

    def _select_one(self, candidates: DraftTree) -> DraftTree:
        if candidates.num_drafted <= self.budget.max_nodes:
            return candidates
        # a node's cumulative score never exceeds its parent's, so the best-scored set is connected;
        # ties are broken towards lower (earlier, shallower) indices to keep it so.
        order = sorted(range(1, len(candidates)), key=lambda i: (-float(candidates.scores[i]), i))
        return candidates.subtree([0] + order[: self.budget.max_nodes])
