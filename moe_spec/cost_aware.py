"""Controllers that price draft nodes with a profile: `truncate` (token-count cost) and `moe-aware`.

Both read the same profile (calibrated acceptance, cost model, expert predictor) and learn the
same bounded online corrections, so comparing them isolates what expert pricing and global
best-first selection add.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch

from moe_spec.acceptance import Acceptance
from moe_spec.cost_model import CostModel, expected_unique_experts
from moe_spec.drafters.base import TreeBudget
from moe_spec.online_correction import AcceptanceCorrection, CostCorrection, ThroughputTracker
from moe_spec.selection import StepPrices, best_first_forest, best_prefix_by_score
from moe_spec.tree import DraftTree


def token_count_cost(profile):
    """(T, B) -> verify ms of a pass of T tokens over B rows from the token count alone: the cost
    model fed the profile's average unique experts for the best-first T nodes of real draft trees
    (what a latency-vs-tokens profile on real trees, as EVICT uses, would measure). Beyond the
    largest tree the curve was measured on, the unique experts stay at that tree's count."""
    cost = profile.cost_model
    if cost.num_layers == 0:
        return lambda tokens, rows=1: cost.fixed_ms(rows) + cost.per_token_ms * tokens
    curve = profile.details.get("routing", {}).get("unique_experts_curve")
    if not curve:
        raise ValueError("this profile has no unique-experts curve for real trees")
    sizes = np.asarray(curve["sizes"], dtype=np.float64)
    real = np.asarray(curve["real"], dtype=np.float64)  # [sizes, L], NaN where no tree was that large
    known = ~np.isnan(real).any(axis=1)
    sizes, real = sizes[known], real[known]
    table: dict[int, np.ndarray] = {}  # T -> [L] unique experts

    def verify_ms(tokens: int, rows: int = 1) -> float:
        if tokens not in table:
            table[tokens] = np.array([np.interp(tokens, sizes, real[:, layer]) for layer in range(real.shape[1])])
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

    def reset(self) -> None:
        if not self.persist:
            self._fresh_corrections()

    def values(self, tree: DraftTree) -> torch.Tensor:
        """[N] calibrated P(on accepted path), corrected per depth, kept non-increasing along paths."""
        values = self.profile.calibrated_path_probability(tree).double().clone()
        values[0] = 1.0
        if self.adapt and len(tree) > 1:
            depths, parents = tree.depths, tree.parents
            deepest = int(depths.max())
            factor = torch.tensor([1.0] + [self.acceptance_correction.factor(d) for d in range(1, deepest + 1)],
                                  dtype=torch.float64)
            values = values * factor[depths]
            for depth in range(1, deepest + 1):  # keep values non-increasing down every path
                level = depths == depth
                values[level] = torch.minimum(values[level], values[parents[level]])
            values[0] = 1.0
        return values

    def cost_model(self) -> CostModel:
        base = self.profile.cost_model
        if not self.adapt:
            return base
        f = self.cost_correction.factor
        return replace(base, base_ms=base.base_ms * f, per_row_ms=base.per_row_ms * f, per_token_ms=base.per_token_ms * f,
                       per_expert_ms=tuple(c * f for c in base.per_expert_ms))

    def _learn_acceptance(self, verified: Sequence[DraftTree], acceptances: Sequence[Acceptance]) -> None:
        for tree, acceptance in zip(verified, acceptances):
            if not tree.num_drafted:
                continue
            values = self.profile.calibrated_path_probability(tree)
            on_path = set(acceptance.path)
            for node, depth in enumerate(tree.depths.tolist()):
                if node:
                    self.acceptance_correction.update(depth, float(values[node]), 1.0 if node in on_path else 0.0)

    def predicted_verify_ms(self, trees: Sequence[DraftTree], cost: CostModel | None = None) -> float:
        """The uncorrected cost model's time for verifying these rows' trees in one pass, padded to
        the widest tree (padding costs tokens, not experts: `batch_layout.step_inputs`)."""
        cost = cost or self.profile.cost_model
        tokens = len(trees) * max(len(t) for t in trees)
        if not cost.num_layers:
            return cost.predict_ms(tokens, [], rows=len(trees))
        probs = torch.cat([self._expert_probs(t) for t in trees], dim=1)  # [L, N, E]
        return cost.predict_ms(tokens, expected_unique_experts(probs), rows=len(trees))

    def _expert_probs(self, tree: DraftTree) -> torch.Tensor | None:
        """[L, N, E] predicted routing, in the form the profile found to predict unique experts best
        (0/1 top-K sets or probabilities; probabilities over many nodes overestimate the union)."""
        if not self.profile.cost_model.num_layers:
            return None
        if self.profile.details.get("expert_predictor", {}).get("pricing") == "topk":
            return self.profile.expert_table.predict_onehot(tree)
        return self.profile.predicted_experts(tree)


class MoeAwareController(_ProfiledController):
    """moe_spec's policy: best-first subtree over the whole candidate tree, each node priced by
    the experts it newly activates (see `selection.py`); no speculation when that wins.

    The candidate tree is sized by the same economics: the drafter expands one level deeper and
    about twice as many nodes as recent steps chose to verify, so no draft time goes to nodes that
    could never pay. Drafting pauses (probing every `probe_every` steps) when several steps in a
    row chose plain decoding, or when the *measured* throughput of speculative steps (tokens per
    ms of draft + verify, a moving average) falls below that of plain steps: the measurement
    covers what the model cannot see, such as the drafter's and the controller's own time.
    """

    name = "moe-aware"

    def __init__(self, profile, price_experts: bool = True, adapt: bool = True, persist: bool = False,
                 recent_steps: int = 4, probe_every: int = 4):
        super().__init__(profile, adapt=adapt, persist=persist)
        self.price_experts = price_experts
        self.recent_steps = recent_steps
        self.probe_every = probe_every
        self._fresh_history()

    def _fresh_history(self) -> None:
        self.rates = ThroughputTracker()
        self._recent: deque[tuple[int, int]] = deque(maxlen=self.recent_steps)  # (nodes, depth) chosen
        self._plain_steps = 0
        self._selected = False  # whether this step's tree went through `select`

    def reset(self) -> None:
        super().reset()
        if not self.persist:
            self._fresh_history()

    def candidate_budget(self, default: TreeBudget) -> TreeBudget:
        if self.adapt and self.rates.plain is None and self.rates.speculative_steps == 2:
            return TreeBudget(0, 0, default.branching)  # one plain step early on, to measure what it costs
        chose_plain = len(self._recent) == self.recent_steps and all(nodes == 0 for nodes, _ in self._recent)
        if chose_plain or (self.adapt and self.rates.speculation_loses()):
            self._plain_steps += 1
            if self._plain_steps % self.probe_every:
                return TreeBudget(0, 0, default.branching)  # speculation has not paid lately: skip drafting
        if len(self._recent) < self.recent_steps:
            return default
        nodes = max(nodes for nodes, _ in self._recent)
        depth = max(depth for _, depth in self._recent)
        return TreeBudget(min(default.max_nodes, max(8, 2 * nodes)), min(default.max_depth, depth + 1), default.branching)

    def select(self, candidates: Sequence[DraftTree], draft_ms: float) -> list[DraftTree]:
        prices = [
            StepPrices(self.values(tree), self._expert_probs(tree) if self.price_experts else None, draft_ms)
            for tree in candidates
        ]
        keeps = best_first_forest(list(candidates), prices, self.cost_model(), draft_ms)
        chosen = [tree.subtree(keep) for tree, keep in zip(candidates, keeps)]
        self._recent.append((max(t.num_drafted for t in chosen), max(int(t.depths.max()) for t in chosen)))
        self._selected = True
        if any(t.num_drafted for t in chosen):
            self._plain_steps = 0
        return chosen

    def feedback(self, verified, acceptances, verify_ms: float, draft_ms: float, routing) -> None:
        speculated = any(t.num_drafted for t in verified)
        self.rates.update(speculated, sum(a.num_accepted + 1 for a in acceptances), draft_ms + verify_ms)
        if self.adapt and speculated:
            self._learn_acceptance(verified, acceptances)
            self.cost_correction.update(self.predicted_verify_ms(verified), verify_ms)
        if not self._selected:  # drafting was skipped (or nothing was drafted): a plain step
            self._recent.append((0, 0))
        self._selected = False


class TruncateController(_ProfiledController):
    """The EVICT idea, rebuilt from its description: draft EAGLE-2's tree, then keep its most
    cost-effective prefix (in draft-score order) under a cost that depends on the token count only."""

    name = "truncate"

    def __init__(self, profile, token_cost, adapt: bool = True, persist: bool = False, budget: TreeBudget | None = None):
        """token_cost: callable (T, B=1) -> verify ms for T tokens over B rows (a token-count-only
        latency curve, e.g. `token_count_cost(profile)`)."""
        super().__init__(profile, adapt=adapt, persist=persist)
        self.token_cost = token_cost
        self.budget = budget or TreeBudget(60, 5, 10)

    def candidate_budget(self, default: TreeBudget) -> TreeBudget:
        return self.budget

    def select(self, candidates: Sequence[DraftTree], draft_ms: float) -> list[DraftTree]:
        """Per row, the best score-order prefix (budgets per row, as EVICT sizes one sequence's tree).

        With B rows in the pass, a row is priced as its share of a pass in which every row keeps as
        many tokens as it does: (token_cost(B * T, B) / B) against draft_ms / B. For B = 1 this is
        EVICT's single-sequence cut; for B > 1 the shared call cost is split between the rows, as the
        feedback's prediction of the whole pass, token_cost(sum T, B), splits it."""
        factor = self.cost_correction.factor if self.adapt else 1.0
        rows = len(candidates)

        def row_share_ms(tokens: int) -> float:
            return factor * self.token_cost(rows * tokens, rows) / rows

        return [
            tree.subtree(best_prefix_by_score(tree, self.values(tree), row_share_ms, draft_ms / rows))
            for tree in candidates
        ]

    def feedback(self, verified, acceptances, verify_ms: float, draft_ms: float, routing) -> None:
        if not self.adapt or not any(t.num_drafted for t in verified):
            return
        self._learn_acceptance(verified, acceptances)
        self.cost_correction.update(self.token_cost(sum(len(t) for t in verified), len(verified)), verify_ms)
