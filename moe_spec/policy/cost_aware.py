"""Controllers that price draft nodes with a profile: `truncate` (token-count cost) and `moe-aware`.

Both read the same profile (calibrated acceptance, cost model, expert predictor) and learn the
same bounded online corrections, so comparing them isolates what expert pricing and global
best-first selection add.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace

import numpy as np
import torch

from moe_spec.core.control import StepPlan
from moe_spec.core.drafting import EAGLE2_BUDGET, NO_DRAFT, TreeBudget
from moe_spec.core.forest import StepForest
from moe_spec.core.step_record import StepRecord
from moe_spec.core.tree import DraftTree
from moe_spec.policy.online_correction import AcceptanceCorrection, CostCorrection, DraftCostTracker, ThroughputTracker
from moe_spec.policy.selection import StepPrices, best_first_forest, best_prefix_by_score
from moe_spec.profile.cost_model import CostModel, expected_unique_experts


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


class _ProfiledController:
    """Shared machinery: calibrated values with online correction, a cost model with online correction."""

    def __init__(self, profile, adapt: bool = True, persist: bool = False):
        if profile.calibration is None:
            raise ValueError("this profile has no acceptance calibration (it was made without a drafter)")
        self.profile = profile
        self.adapt = adapt
        self.persist = persist
        self._fresh_corrections()

    def _fresh_corrections(self) -> None:
        self.acceptance_correction = AcceptanceCorrection()
        self.cost_correction = CostCorrection()

    def begin(self, default: TreeBudget) -> TreeBudget:
        if not self.persist:
            self._fresh_corrections()
        return default

    def values(self, tree: DraftTree) -> torch.Tensor:
        """[N] calibrated P(on accepted path), corrected per depth, kept non-increasing along paths."""
        return self.values_of(StepForest((tree,)))[0]

    def values_of(self, forest: StepForest) -> list[torch.Tensor]:
        """`values` of every row's tree, computed over all rows' nodes at once (each tree's [N_b])."""
        forest = StepForest.of(forest)
        values = self._calibrated(forest)
        depths, parents = forest.depths, forest.parent_or_self
        levels = [depths == depth for depth in range(1, forest.max_depth + 1)]
        if self.adapt and levels:
            factor = np.array([1.0] + [self.acceptance_correction.factor(d) for d in range(1, len(levels) + 1)])
            values = values * factor[depths]
            for level in levels:  # keep values non-increasing down every path
                values[level] = np.minimum(values[level], values[parents[level]])
        values[depths == 0] = 1.0
        return forest.split(torch.from_numpy(values))

    def _calibrated(self, forest: StepForest) -> np.ndarray:
        """[N] over all rows' nodes: the profile's calibrated P(on accepted path), as
        `AcceptanceCalibration.path_probability` computes it for one tree."""
        depths, parents, scores = forest.depths, forest.parent_or_self, forest.scores
        conditional = self.profile.calibration.conditional_probability_of(np.exp(scores - scores[parents]), depths)
        conditional[depths == 0] = 1.0
        values = conditional.copy()
        for depth in range(1, forest.max_depth + 1):  # path products, one level at a time
            level = depths == depth
            values[level] = values[parents[level]] * conditional[level]
        return values

    def cost_model(self) -> CostModel:
        base = self.profile.cost_model
        if not self.adapt:
            return base
        return replace(base, base_ms=max(base.base_ms + self.cost_correction.offset_ms, 0.0))

    def _learn_acceptance(self, record: StepRecord) -> None:
        drafted = [b for b, tree in enumerate(record.verified) if tree.num_drafted]
        if not drafted:
            return
        forest = StepForest(tuple(record.verified[b] for b in drafted))
        values = self._calibrated(forest)
        on_path = np.zeros(forest.num_nodes)
        for row, b in enumerate(drafted):
            on_path[forest.offsets[row] + np.asarray(record.acceptances[b].path)] = 1.0
        for depth in range(1, forest.max_depth + 1):
            level = forest.depths == depth
            self.acceptance_correction.update(depth, float(values[level].sum()), float(on_path[level].sum()))

    def predicted_verify_ms(self, forest: StepForest, cost: CostModel | None = None) -> float:
        """The uncorrected cost model's time for verifying these rows' trees in one padded pass
        (padding costs tokens, not experts: `batch_layout.step_inputs`)."""
        forest = StepForest.of(forest)
        cost = cost or self.profile.cost_model
        if not cost.num_layers:
            return cost.predict_ms(forest.pass_tokens, [], rows=forest.rows)
        probs = self._expert_probs(forest)  # [L, N, E]
        return cost.predict_ms(forest.pass_tokens, expected_unique_experts(probs), rows=forest.rows)

    def _expert_probs(self, forest: StepForest) -> torch.Tensor | None:
        """[L, N, E] predicted routing of every row's nodes, in the form the profile found to predict
        unique experts best (0/1 top-K sets or probabilities; probabilities over many nodes
        overestimate the union); None for a dense target."""
        if not self.profile.cost_model.num_layers:
            return None
        return self.profile.priced_experts(forest.tokens)


class MoeAwareController(_ProfiledController):
    """moe_spec's policy: best-first subtree over the whole candidate tree, each node priced by
    the experts it newly activates (see `selection.py`); no speculation when that wins.

    The candidate tree is sized by the same economics: the drafter expands `candidate_growth` times
    as many nodes per row as recent steps chose to verify (at least `candidate_min`; starting from
    10 nodes, 4 deep), as deep as they went, and one level deeper when a recent choice used the
    candidates' last level (so deeper trees are explored where they might pay, and no level is
    drafted every step only to be dropped). Selection prices drafting by depth (see `selection.py`),
    so a generous candidate tree does not inflate the next one. Drafting pauses (probing every
    `probe_every` steps) when several steps in a row chose plain decoding, or when the *measured*
    throughput of speculative steps (tokens per ms of draft + plan + verify, a moving average) falls
    below that of plain steps: the measurement covers what the model cannot see, such as the
    drafter's and the controller's own time.
    """

    name = "moe-aware"

    def __init__(self, profile, price_experts: bool = True, adapt: bool = True, persist: bool = False,
                 recent_steps: int = 4, probe_every: int = 4, candidate_growth: float = 1.25, candidate_min: int = 4):
        super().__init__(profile, adapt=adapt, persist=persist)
        self.price_experts = price_experts
        self.candidate_growth = candidate_growth
        self.candidate_min = candidate_min
        self.recent_steps = recent_steps
        self.probe_every = probe_every
        self._default = EAGLE2_BUDGET
        self._fresh_history()

    def _fresh_history(self) -> None:
        self.rates = ThroughputTracker()
        self._recent: deque[tuple[int, int, bool]] = deque(maxlen=self.recent_steps)  # (nodes, depth, at edge) chosen
        self._plain_steps = 0
        self.draft_costs = DraftCostTracker()

    def begin(self, default: TreeBudget) -> TreeBudget:
        super().begin(default)
        if not self.persist:
            self._fresh_history()
        self._default = default
        return self._next_budget()

    def plan(self, candidates: StepForest, draft_ms: float) -> StepPlan:
        candidates = StepForest.of(candidates)
        if candidates.num_drafted == 0:  # drafting was skipped: a plain step
            self._recent.append((0, 0, False))
            return StepPlan(candidates, self._next_budget())
        probs = self._expert_probs(candidates) if self.price_experts else None
        row_probs = probs.split(candidates.sizes.tolist(), dim=1) if probs is not None else [None] * candidates.rows
        prices = [StepPrices(values, p) for values, p in zip(self.values_of(candidates), row_probs)]  # p: [L, N_b, E]
        self.draft_costs.update(candidates.max_depth, draft_ms)
        fixed_ms, depth_ms = self.draft_costs.estimate()
        keeps = best_first_forest(candidates, prices, self.cost_model(), depth_ms, draft_fixed_ms=fixed_ms)
        chosen = candidates.subforest(keeps)
        self._recent.append((max(t.num_drafted for t in chosen), chosen.max_depth, chosen.max_depth >= candidates.max_depth))
        if chosen.num_drafted:
            self._plain_steps = 0
        return StepPlan(chosen, self._next_budget())

    def observe(self, record: StepRecord) -> None:
        self.rates.update(record.speculated, record.tokens_produced, record.draft_ms + record.plan_ms + record.verify_ms)
        if self.adapt:  # plain passes measure the fixed cost too
            self.cost_correction.update(self.predicted_verify_ms(record.verified), record.verify_ms)
        if self.adapt and record.speculated:
            self._learn_acceptance(record)

    def _next_budget(self) -> TreeBudget:
        """The candidate tree to draft next, from the recent choices and measured rates."""
        default = self._default
        if self.adapt and self.rates.plain is None and self.rates.speculative_steps == 2:
            return NO_DRAFT  # one plain step early on, to measure what it costs
        chose_plain = len(self._recent) == self.recent_steps and all(nodes == 0 for nodes, _, _ in self._recent)
        if chose_plain or (self.adapt and self.rates.speculation_loses()):
            self._plain_steps += 1
            if self._plain_steps % self.probe_every:
                return NO_DRAFT  # speculation has not paid lately: skip drafting
        if len(self._recent) < self.recent_steps:
            return self._sized(default, 8, 3)
        nodes = max(nodes for nodes, _, _ in self._recent)
        depth = max(depth for _, depth, _ in self._recent)
        deeper = any(edge for _, _, edge in self._recent)  # a recent choice used the candidates' last level
        return self._sized(default, nodes, depth, deeper)

    def _sized(self, default: TreeBudget, nodes: int, depth: int, deeper: bool = True) -> TreeBudget:
        """A candidate tree around `nodes` chosen nodes per row `depth` deep: `candidate_growth` times
        the nodes, one level deeper if `deeper`, and only as many expansions per level as that many
        nodes can use (each expansion is a row of the head's forward and of its output projection)."""
        nodes = min(default.max_nodes, max(self.candidate_min, round(self.candidate_growth * nodes)))
        depth = min(default.max_depth, max(depth + deeper, 1))
        return TreeBudget(nodes, depth, min(default.branching, max(2, -(-nodes // depth))))


class TruncateController(_ProfiledController):
    """The EVICT idea, rebuilt from its description: draft EAGLE-2's tree, then keep its most
    cost-effective prefix (in draft-score order) under a cost that depends on the token count only."""

    name = "truncate"

    def __init__(self, profile, token_cost, adapt: bool = True, persist: bool = False, budget: TreeBudget | None = None):
        """token_cost: callable (T, B=1) -> verify ms for T tokens over B rows (a token-count-only
        latency curve, e.g. `token_count_cost(profile)`)."""
        super().__init__(profile, adapt=adapt, persist=persist)
        self.token_cost = token_cost
        self.budget = budget or EAGLE2_BUDGET

    def begin(self, default: TreeBudget) -> TreeBudget:
        super().begin(default)
        return self.budget

    def plan(self, candidates: StepForest, draft_ms: float) -> StepPlan:
        """Per row, the best score-order prefix (budgets per row, as EVICT sizes one sequence's tree).

        With B rows in the pass, a row is priced as its share of a pass in which every row keeps as
        many tokens as it does: (token_cost(B * T, B) / B) against draft_ms / B. For B = 1 this is
        EVICT's single-sequence cut; for B > 1 the shared call cost is split between the rows, as the
        observed pass's prediction, token_cost(B x width, B), splits it."""
        candidates = StepForest.of(candidates)
        if candidates.num_drafted == 0:
            return StepPlan(candidates, self.budget)
        offset = self.cost_correction.offset_ms if self.adapt else 0.0
        rows = candidates.rows

        def row_share_ms(tokens: int) -> float:
            return max(self.token_cost(rows * tokens, rows) + offset, 0.0) / rows

        keeps = [best_prefix_by_score(tree, values, row_share_ms, draft_ms / rows)
                 for tree, values in zip(candidates, self.values_of(candidates))]
        return StepPlan(candidates.subforest(keeps), self.budget)

    def observe(self, record: StepRecord) -> None:
        if not self.adapt or not record.speculated:
            return
        self._learn_acceptance(record)
        self.cost_correction.update(self.token_cost(record.verified.pass_tokens, record.verified.rows), record.verify_ms)
