"""`TruncateController`: the EVICT idea (an EAGLE-2 tree cut to its most cost-effective prefix
under a token-count-only cost), rebuilt from its description, and that token-count cost curve."""

from __future__ import annotations

import numpy as np

from moe_spec.core.control import StepPlan
from moe_spec.core.drafting import EAGLE2_BUDGET, TreeBudget
from moe_spec.core.forest import StepForest
from moe_spec.core.sampling import GREEDY, SamplingConfig
from moe_spec.core.step_record import StepRecord
from moe_spec.policy.candidate_scheme import CandidateScheme, drawn, with_scheme
from moe_spec.policy.profiled import ProfiledController
from moe_spec.policy.selection import best_prefix_by_score


def token_count_cost(profile):
    """(T, B) -> verify ms of a pass of T tokens over B rows from the token count alone: the cost
    model fed the profile's average unique experts for the best-first T nodes of real draft trees
    (what a latency-vs-tokens profile on real trees, as EVICT uses, would measure). Beyond the
    largest tree the curve was measured on, the unique experts stay at that tree's count."""
    cost = profile.cost_model
    if cost.num_layers == 0:
        return lambda tokens, rows=1: cost.fixed_ms(rows) + cost.per_token_ms * tokens
    curve = profile.unique_experts_curve
    if curve is None:
        raise ValueError("this profile has no unique-experts curve for real trees")
    table: dict[int, np.ndarray] = {}  # T -> [L] unique experts

    def verify_ms(tokens: int, rows: int = 1) -> float:
        if tokens not in table:
            table[tokens] = curve.real_at(tokens)
        return cost.predict_ms(tokens, table[tokens], rows)

    return verify_ms


class TruncateController(ProfiledController):
    """The EVICT idea, rebuilt from its description: draft EAGLE-2's tree, then keep its most
    cost-effective prefix (in draft-score order) under a cost that depends on the token count only."""

    name = "truncate"

    def __init__(self, profile, token_cost, adapt: bool = True, persist: bool = False, budget: TreeBudget | None = None,
                 scheme: CandidateScheme = CandidateScheme.AUTO):
        """token_cost: callable (T, B=1) -> verify ms for T tokens over B rows (a token-count-only
        latency curve, e.g. `token_count_cost(profile)`)."""
        super().__init__(profile, adapt=adapt, persist=persist, scheme=scheme)
        self.token_cost = token_cost
        self.budget = budget or EAGLE2_BUDGET

    def begin(self, default: TreeBudget, sampling: SamplingConfig = GREEDY) -> TreeBudget:
        super().begin(default, sampling)
        self.budget = with_scheme(self.budget, self.sampled)  # token-count pricing: no routing, no node features
        return self.budget

    def plan(self, candidates: StepForest, draft_ms: float) -> StepPlan:
        """Per row, the best score-order prefix (budgets per row, as EVICT sizes one sequence's tree).

        With B rows in the pass, a row is priced as its share of a pass in which every row keeps as
        many tokens as it does: (token_cost(B * T, B) / B) against draft_ms / B. For B = 1 this is
        EVICT's single-sequence cut; for B > 1 the shared call cost is split between the rows, as the
        observed pass's prediction, token_cost(B x width, B), splits it."""
        candidates = StepForest.of(candidates)
        if candidates.num_drafted == 0 or drawn(candidates):  # sampled trees: no cut is exact
            return StepPlan(candidates, self.budget)
        scale = self.cost_correction.scale if self.adapt else 1.0
        rows = candidates.rows
        offset = self.cost_correction.offset_ms(rows) if self.adapt else 0.0

        def row_share_ms(tokens: int) -> float:
            return max(scale * self.token_cost(rows * tokens, rows) + offset, 0.0) / rows

        keeps = [best_prefix_by_score(tree, values, row_share_ms, draft_ms / rows)
                 for tree, values in zip(candidates, self.values_of(candidates))]
        return StepPlan(candidates.subforest(keeps), self.budget)

    def observe(self, record: StepRecord) -> None:
        if not self.adapt or not record.speculated:
            return
        self._learn_acceptance(record)
        self.cost_correction.update(self.token_cost(record.verified.pass_tokens, record.verified.rows), record.verify_ms,
                                    rows=record.verified.rows)
