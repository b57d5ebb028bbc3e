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

from moe_spec.core.acceptance import Acceptance
from moe_spec.profile.cost_model import CostModel, expected_unique_experts
from moe_spec.core.drafting import TreeBudget
from moe_spec.policy.online_correction import AcceptanceCorrection, CostCorrection, DraftCostTracker, ThroughputTracker
from moe_spec.policy.selection import StepPrices, best_first_forest, best_prefix_by_score
from moe_spec.core.tree import DraftTree


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
        return self.values_of([tree])[0]

    def values_of(self, trees: Sequence[DraftTree]) -> list[torch.Tensor]:
        """`values` of every row's tree, computed over all rows' nodes at once (each tree's [N])."""
        values, depths, parents = self._calibrated(trees)
        levels = [depths == depth for depth in range(1, int(depths.max()) + 1)]
        if self.adapt and levels:
            factor = np.array([1.0] + [self.acceptance_correction.factor(d) for d in range(1, len(levels) + 1)])
            values = values * factor[depths]
            for level in levels:  # keep values non-increasing down every path
                values[level] = np.minimum(values[level], values[parents[level]])
        values[depths == 0] = 1.0
        return list(torch.from_numpy(values).split([len(t) for t in trees]))

    def _calibrated(self, trees: Sequence[DraftTree]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Over all rows' nodes side by side: the profile's calibrated P(on accepted path) [N] (as
        `Profile.calibrated_path_probability`), depths [N] and parents [N] (a root is its own parent)."""
        offsets = np.cumsum([0] + [len(t) for t in trees][:-1])
        parents = np.concatenate([np.where(t.parents.numpy() >= 0, t.parents.numpy() + o, np.arange(len(t)) + o)
                                  for t, o in zip(trees, offsets)])
        depths = np.concatenate([t.depths.numpy() for t in trees])
        scores = np.concatenate([t.scores.double().numpy() for t in trees])
        conditional = self.profile.calibration.conditional_probability_of(np.exp(scores - scores[parents]), depths)
        conditional[depths == 0] = 1.0
        values = conditional.copy()
        for depth in range(1, int(depths.max()) + 1):  # path products, one level at a time
            level = depths == depth
            values[level] = values[parents[level]] * conditional[level]
        return values, depths, parents

    def cost_model(self) -> CostModel:
        base = self.profile.cost_model
        if not self.adapt:
            return base
        return replace(base, base_ms=max(base.base_ms + self.cost_correction.offset_ms, 0.0))

    def _learn_acceptance(self, verified: Sequence[DraftTree], acceptances: Sequence[Acceptance]) -> None:
        trees = [t for t in verified if t.num_drafted]
        if not trees:
            return
        values, depths, _ = self._calibrated(trees)
        offsets = np.cumsum([0] + [len(t) for t in trees][:-1])
        on_path = np.zeros(len(depths))
        on_path[np.concatenate([o + np.asarray(a.path) for o, a in zip(offsets, (a for t, a in zip(verified, acceptances)
                                                                                 if t.num_drafted))])] = 1.0
        for depth in range(1, int(depths.max()) + 1):
            level = depths == depth
            self.acceptance_correction.update(depth, float(values[level].sum()), float(on_path[level].sum()))

    def predicted_verify_ms(self, trees: Sequence[DraftTree], cost: CostModel | None = None) -> float:
        """The uncorrected cost model's time for verifying these rows' trees in one pass, padded to
        the widest tree (padding costs tokens, not experts: `batch_layout.step_inputs`)."""
        cost = cost or self.profile.cost_model
        tokens = len(trees) * max(len(t) for t in trees)
        if not cost.num_layers:
            return cost.predict_ms(tokens, [], rows=len(trees))
        probs = torch.cat(self._expert_probs_of(trees), dim=1)  # [L, N, E]
        return cost.predict_ms(tokens, expected_unique_experts(probs), rows=len(trees))

    def _expert_probs(self, tree: DraftTree) -> torch.Tensor | None:
        """[L, N, E] predicted routing, in the form the profile found to predict unique experts best
        (0/1 top-K sets or probabilities; probabilities over many nodes overestimate the union)."""
        return self._expert_probs_of([tree])[0]

    def _expert_probs_of(self, trees: Sequence[DraftTree]) -> list[torch.Tensor | None]:
        """`_expert_probs` of every row's tree, looked up for all rows' tokens at once."""
        if not self.profile.cost_model.num_layers:
            return [None] * len(trees)
        tokens = torch.cat([t.tokens for t in trees])  # [N] all rows' nodes
        table = self.profile.expert_table
        if self.profile.details.get("expert_predictor", {}).get("pricing") == "topk":
            probs = table.predict_onehot_tokens(tokens)
        else:
            probs = table.predict_tokens(tokens)
        return list(probs.split([len(t) for t in trees], dim=1))  # each [L, N_b, E]


class MoeAwareController(_ProfiledController):
    """moe_spec's policy: best-first subtree over the whole candidate tree, each node priced by
    the experts it newly activates (see `selection.py`); no speculation when that wins.

    The candidate tree is sized by the same economics: the drafter expands `candidate_growth` times
    as many nodes per row as recent steps chose to verify (at least `candidate_min`; starting from
    10 nodes, 4 deep), as deep as they went, and one level deeper when a recent choice used the
    candidates' last level (so deeper trees are explored where they might pay, and no level is
    drafted every step only to be dropped). Selection prices drafting by depth (see `selection.py`), so a generous candidate
    tree does not inflate the next one. Drafting pauses (probing every `probe_every` steps) when
    several steps in a row chose plain decoding, or when the *measured* throughput of speculative
    steps (tokens per ms of draft + verify, a moving average) falls below that of plain steps: the
    measurement covers what the model cannot see, such as the drafter's and the controller's own
    time.
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
        self._fresh_history()

    def _fresh_history(self) -> None:
        self.rates = ThroughputTracker()
        self._recent: deque[tuple[int, int, bool]] = deque(maxlen=self.recent_steps)  # (nodes, depth, at edge) chosen
        self._plain_steps = 0
        self._selected = False  # whether this step's tree went through `select`
        self.draft_costs = DraftCostTracker()

    def reset(self) -> None:
        super().reset()
        if not self.persist:
            self._fresh_history()

    def candidate_budget(self, default: TreeBudget) -> TreeBudget:
        if self.adapt and self.rates.plain is None and self.rates.speculative_steps == 2:
            return TreeBudget(0, 0, default.branching)  # one plain step early on, to measure what it costs
        chose_plain = len(self._recent) == self.recent_steps and all(nodes == 0 for nodes, _, _ in self._recent)
        if chose_plain or (self.adapt and self.rates.speculation_loses()):
            self._plain_steps += 1
            if self._plain_steps % self.probe_every:
                return TreeBudget(0, 0, default.branching)  # speculation has not paid lately: skip drafting
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

    def select(self, candidates: Sequence[DraftTree], draft_ms: float) -> list[DraftTree]:
        probs = self._expert_probs_of(candidates) if self.price_experts else [None] * len(candidates)
        prices = [StepPrices(values, p) for values, p in zip(self.values_of(candidates), probs)]
        self.draft_costs.update(max(int(t.depths.max()) for t in candidates), draft_ms)
        fixed_ms, depth_ms = self.draft_costs.estimate()
        keeps = best_first_forest(list(candidates), prices, self.cost_model(), depth_ms, draft_fixed_ms=fixed_ms)
        chosen = [tree.subtree(keep) for tree, keep in zip(candidates, keeps)]
        depth = max(int(t.depths.max()) for t in chosen)
        self._recent.append((max(t.num_drafted for t in chosen), depth, depth >= max(int(t.depths.max()) for t in candidates)))
        self._selected = True
        if any(t.num_drafted for t in chosen):
            self._plain_steps = 0
        return chosen

    def feedback(self, verified, acceptances, verify_ms: float, draft_ms: float, routing) -> None:
        speculated = any(t.num_drafted for t in verified)
        self.rates.update(speculated, sum(a.num_accepted + 1 for a in acceptances), draft_ms + verify_ms)
        if self.adapt:  # plain passes measure the fixed cost too
            self.cost_correction.update(self.predicted_verify_ms(verified), verify_ms)
        if self.adapt and speculated:
            self._learn_acceptance(verified, acceptances)
        if not self._selected:  # drafting was skipped (or nothing was drafted): a plain step
            self._recent.append((0, 0, False))
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
        offset = self.cost_correction.offset_ms if self.adapt else 0.0
        rows = len(candidates)

        def row_share_ms(tokens: int) -> float:
            return max(self.token_cost(rows * tokens, rows) + offset, 0.0) / rows

        return [
            tree.subtree(best_prefix_by_score(tree, self.values(tree), row_share_ms, draft_ms / rows))
            for tree in candidates
        ]

    def feedback(self, verified, acceptances, verify_ms: float, draft_ms: float, routing) -> None:
        if not self.adapt or not any(t.num_drafted for t in verified):
            return
        self._learn_acceptance(verified, acceptances)
        pass_tokens = len(verified) * max(len(t) for t in verified)  # rows are padded to the widest
        self.cost_correction.update(self.token_cost(pass_tokens, len(verified)), verify_ms)
