"""`StaticController`: a fixed node budget per row (the `static:N` and `eagle2` methods)."""

from __future__ import annotations

from collections.abc import Callable

from moe_spec.core.control import StepPlan
from moe_spec.core.drafting import TreeBudget
from moe_spec.core.forest import StepForest
from moe_spec.core.sampling import GREEDY, SamplingConfig
from moe_spec.core.step_record import StepRecord
from moe_spec.core.tree import DraftTree
from moe_spec.errors import InputError
from moe_spec.policy.candidate_scheme import CandidateScheme, drawn, resolve_scheme, with_scheme


class StaticController:
    """Draft to `budget` every step and verify each row's `budget.max_nodes` best-scored nodes
    (sampled candidates: as drafted, which is at most that many). `scheme` picks the candidates when
    sampling; `profile` (a callable giving the target's profile, or None) serves `auto`."""

    name = "static"

    def __init__(self, budget: TreeBudget, scheme: CandidateScheme = CandidateScheme.TOP,
                 profile: Callable[[], object] | None = None):
        self.budget = budget
        self.scheme = CandidateScheme(scheme)
        self._profile = profile
        self._step_budget = budget

    def begin(self, default: TreeBudget, sampling: SamplingConfig = GREEDY) -> TreeBudget:
        profile = None
        if self.scheme is CandidateScheme.AUTO and not sampling.greedy and self._profile is not None:
            try:
                profile = self._profile()
            except InputError:  # none was given: `auto` keeps top tokens, and says so
                profile = None
        self._step_budget = with_scheme(self.budget, resolve_scheme(self.scheme, sampling, profile))
        return self._step_budget

    def plan(self, candidates: StepForest, draft_ms: float = 0.0) -> StepPlan:
        if drawn(candidates):
            return StepPlan(StepForest.of(candidates), self._step_budget)
        return StepPlan(StepForest(tuple(self._select_one(tree) for tree in candidates)), self._step_budget)

    def observe(self, record: StepRecord) -> None:
        pass

    def _select_one(self, candidates: DraftTree) -> DraftTree:
        if candidates.num_drafted <= self.budget.max_nodes:
            return candidates
        # a node's cumulative score never exceeds its parent's, so the best-scored set is connected;
        # ties are broken towards lower (earlier, shallower) indices to keep it so.
        order = sorted(range(1, len(candidates)), key=lambda i: (-float(candidates.scores[i]), i))
        return candidates.subtree([0] + order[: self.budget.max_nodes])
