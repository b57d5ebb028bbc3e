"""What the profile-driven controllers share: calibrated node values with an online acceptance
correction, the profile's cost model with an online offset, and the predicted routing of nodes.

`truncate` (`policy/truncate.py`) and `moe-aware` (`policy/moe_aware.py`) both build on it, so
comparing them isolates what expert pricing and global best-first selection add.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from moe_spec.core.drafting import TreeBudget
from moe_spec.core.forest import StepForest
from moe_spec.core.sampling import GREEDY, SamplingConfig
from moe_spec.core.step_record import StepRecord
from moe_spec.core.tree import DraftTree
from moe_spec.policy.candidate_scheme import CandidateScheme, resolve_scheme, with_scheme
from moe_spec.policy.online_correction import AcceptanceCorrection, CostCorrection
from moe_spec.policy.row_growth import ExpertSets, flat_expert_sets
from moe_spec.profile.artifact import ExpertPricing
from moe_spec.profile.cost_model import CostModel, expected_unique_experts


class ProfiledController:
    """Shared machinery: calibrated values with online correction, a cost model with online correction."""

    def __init__(self, profile, adapt: bool = True, persist: bool = False, scheme: CandidateScheme = CandidateScheme.AUTO):
        if profile.calibration is None:
            raise ValueError("this profile has no acceptance calibration (it was made without a drafter)")
        self.profile = profile
        self.adapt = adapt
        self.persist = persist
        self.scheme = CandidateScheme(scheme)
        self.sampled = False  # this request's candidates are sampled (set by `begin`)
        self.calibration = profile.calibration  # the acceptance calibration matching this request
        self._last_calibrated: tuple[StepForest, tuple[float, ...]] | None = None  # (forest, its calibrated values)
        self._scaled: tuple[tuple[float, float, float], CostModel] | None = None  # (correction, the cost model it scales)
        self._fresh_corrections()

    def _fresh_corrections(self) -> None:
        self.acceptance_correction = AcceptanceCorrection()
        self.cost_correction = CostCorrection()

    def begin(self, default: TreeBudget, sampling: SamplingConfig = GREEDY) -> TreeBudget:
        if not self.persist:
            self._fresh_corrections()
        self.sampled = resolve_scheme(self.scheme, sampling, self.profile)
        self.calibration = self.profile.calibration_for(sampling, self.sampled)
        self._last_calibrated = None  # values under another request's calibration
        return with_scheme(default, self.sampled).with_node_features(self.wants_node_features)

    @property
    def wants_node_features(self) -> bool:
        """The profile prices nodes by the head routing predictor, which reads each node's parent head
        output: budgets this controller returns ask the drafter for it (`TreeBudget.node_features`)."""
        head = self.profile.head_routing
        return head is not None and head.chosen and bool(self.profile.cost_model.num_layers)

    def values(self, tree: DraftTree) -> torch.Tensor:
        """[N] calibrated P(on accepted path), corrected per depth, kept non-increasing along paths."""
        return self.values_of(StepForest((tree,)))[0]

    def values_of(self, forest: StepForest) -> list[torch.Tensor]:
        """`values` of every row's tree (each tree's [N_b] float64)."""
        return [torch.tensor(row, dtype=torch.float64) for row in self._value_rows(StepForest.of(forest))]

    def _value_rows(self, forest: StepForest) -> list[list[float]]:
        """`values_of` as Python floats, in plain Python node by node (parents come first): a few
        dozen nodes a step, where each numpy or torch call costs more than its arithmetic."""
        calibrated = self._calibrated(forest)  # roots 1; kept as computed for `observe`
        starts = forest.row_starts
        if not self.adapt:
            return [list(calibrated[start:end]) for start, end in zip(starts, starts[1:])]
        factor = self.acceptance_correction.factor
        factors = [1.0] + [factor(depth) for depth in range(1, forest.max_depth + 1)]
        out = []
        for tree, start in zip(forest.trees, starts):
            parents, depths = tree.parent_list, tree.depth_list
            clamped = list(calibrated[start:start + len(parents)])
            for node in range(1, len(clamped)):  # non-increasing down paths
                clamped[node] = min(clamped[node] * factors[depths[node]], clamped[parents[node]])
            out.append(clamped)
        return out

    def _calibrated(self, forest: StepForest) -> tuple[float, ...]:
        """[N] over all rows' nodes: the profile's calibrated P(on accepted path), as
        `AcceptanceCalibration.path_probability` computes it for one tree. The last forest's values
        are kept (`_last_calibrated`): a step's plan and its observe read the same candidates."""
        last = self._last_calibrated
        if last is not None and last[0] is forest:
            return last[1]
        values = self._calibrated_afresh(forest)
        self._last_calibrated = (forest, values)
        return values

    def _calibrated_afresh(self, forest: StepForest) -> tuple[float, ...]:
        """Every row's nodes in plain Python, node by node (parents come first): a few dozen nodes a
        row, where each numpy call costs more than its arithmetic. A parent's first child is mapped
        apart from its later siblings (`AcceptanceCalibration`)."""
        calibration = self.calibration
        maps = [(None, None)] + [(calibration.conditional_map(depth), calibration.conditional_map(depth, True))
                                 for depth in range(1, forest.max_depth + 1)]  # (later siblings, first child) per depth
        out: list[float] = []
        for tree in forest.trees:
            scores, parents, depths, ranks = tree.score_list, tree.parent_list, tree.depth_list, tree.rank_list
            values = [1.0] * len(scores)
            for node in range(1, len(scores)):
                parent = parents[node]
                conditional = maps[depths[node]][ranks[node] == 0].at(math.exp(scores[node] - scores[parent]))
                values[node] = conditional * values[parent]
            out += values
        return tuple(out)

    def cost_model(self) -> CostModel:
        base = self.profile.cost_model
        if not self.adapt:
            return base
        correction = self.cost_correction
        key = (correction.log_scale, correction.row_ms, correction.fetch_scale)
        if self._scaled is None or self._scaled[0] != key:  # rebuilt when the correction moved
            self._scaled = (key, base.scaled(correction.scale, correction.row_ms, correction.fetch_scale))
        return self._scaled[1]

    def _learn_acceptance(self, record: StepRecord, values: Sequence[float] | None = None) -> None:
        """Per depth, the verified nodes' calibrated values against the accepted paths' nodes.
        `values` [N]: the calibrated values of `record.verified`'s nodes when the caller knows them
        (the plan computed them on the candidates); else the candidates' values when nothing was
        cut, else computed afresh. A row verified as its root alone has no node of depth >= 1."""
        verified = StepForest.of(record.verified)
        if not verified.num_drafted:
            return
        if values is None:
            candidates = self._last_calibrated[0] if self._last_calibrated is not None else None
            same = candidates is not None and len(verified.trees) == len(candidates.trees) and all(
                a is b for a, b in zip(verified.trees, candidates.trees))  # nothing was cut: values known
            values = self._calibrated(candidates if same else verified)
        # a few dozen nodes a row: plain Python sums per depth
        bins = verified.max_depth + 1
        predicted, observed = [0.0] * bins, [0] * bins  # expected and accepted path nodes per depth
        values = iter(values)
        for tree, acceptance in zip(verified.trees, record.acceptances):
            depths = tree.depth_list
            for depth in depths:
                predicted[depth] += next(values)
            for node in acceptance.path:
                observed[depths[node]] += 1
        for depth in range(1, bins):
            self.acceptance_correction.update(depth, predicted[depth], float(observed[depth]))

    def predicted_verify_ms(self, forest: StepForest, cost: CostModel | None = None, misses=None) -> float:
        """The uncorrected cost model's time for verifying these rows' trees in one padded pass
        (padding costs tokens, not experts: `batch_layout.step_inputs`); `misses` [L]: the experts the
        pass fetched per layer (offloaded experts), priced when the cost model has a fetch cost."""
        forest = StepForest.of(forest)
        cost = cost or self.profile.cost_model
        if not cost.num_layers:
            return cost.predict_ms(forest.pass_tokens, [], rows=forest.rows)
        probs = self._expert_probs(forest)  # [L, N, E]
        return cost.predict_ms(forest.pass_tokens, expected_unique_experts(probs), rows=forest.rows, misses=misses)

    def _expert_probs(self, forest: StepForest) -> torch.Tensor | None:
        """[L, N, E] predicted routing of every row's nodes, in the form the profile found to predict
        unique experts best (0/1 top-K sets or probabilities; probabilities over many nodes
        overestimate the union); None for a dense target. From the head routing predictor's top-K
        sets when the profile keeps it and the trees carry node features, else the token table.

        The one override point for where routing comes from: `experiments/bounds.py`'s replay
        oracle prices each node by the routing its trace recorded instead (bound (b))."""
        if not self.profile.cost_model.num_layers:
            return None
        features = _node_features(forest) if self.wants_node_features else None
        if features is None:  # a drafter that carries none (the lookup drafter), or the table was kept
            return self.profile.priced_experts(forest.tokens)
        predictor = self.profile.head_routing.predictor
        return predictor.predict_onehot(features, forest.tokens, torch.from_numpy(forest.depths), self.profile.expert_table)

    def _expert_sets(self, forest: StepForest) -> ExpertSets | None:
        """The routing `_expert_probs` predicts, as flat (layer * E + expert) id masks, when the
        profile prices 0/1 top-K sets (the growth in plain Python reads these; no one-hot is built); None
        for a dense target or probability pricing. Where routing comes from is overridden in
        `_expert_probs`: an override there is read through `flat_expert_sets` here."""
        if type(self)._expert_probs is not ProfiledController._expert_probs:  # routing from elsewhere
            probs = self._expert_probs(forest)
            return flat_expert_sets(probs) if probs is not None else None
        cost, table = self.profile.cost_model, self.profile.expert_table
        if not cost.num_layers:
            return None
        features = _node_features(forest) if self.wants_node_features else None
        tokens = forest.tokens.tolist()
        if features is not None:  # drafted nodes by the head's predictor, every row's root by the table
            masks = self.profile.head_routing.predictor.predict_drafted_masks(features, forest.tokens, table)
            for root in forest.row_starts[:-1]:
                masks[root] = table.flat_id_mask(tokens[root])
        elif self.profile.expert_pricing is ExpertPricing.TOPK:
            masks = [table.flat_id_mask(token) for token in tokens]
        else:
            return None
        return ExpertSets(masks, table.num_experts)


def _node_features(forest: StepForest) -> torch.Tensor | None:
    """[N, D] every row's `node_features` side by side (a root-only tree needs none: roots are priced
    by the table), or None when a drafted tree carries none."""
    parts = [tree.node_features for tree in forest.trees if tree.node_features is not None]
    if not parts:
        return None
    if len(parts) == forest.rows:
        return parts[0] if forest.rows == 1 else torch.cat(parts)
    if any(tree.node_features is None and tree.num_drafted for tree in forest.trees):
        return None
    root = parts[0].new_zeros(1, parts[0].shape[1])
    return torch.cat([tree.node_features if tree.node_features is not None else root for tree in forest.trees])
