"""Choosing which drafted nodes to verify: the economics of one speculative step, as pure functions.

A step verifies a connected subtree S of the candidate tree (root always included) and
produces on average 1 + sum_{i in S, i != root} v_i tokens, where v_i is the calibrated
probability that node i lies on the accepted path (the 1 is the bonus token). It costs the
draft time of the depth S reaches, d(S) = depth_ms * depth(S), plus the verify time

    t(S) = base_ms + per_row_ms * (B - 1) + per_token_ms * T + sum_l per_expert_ms[l] * U_l(S),

U_l(S) = sum_e 1 - prod_{i in S} (1 - p_{l,i,e}) being the expected number of distinct experts
layer l loads for S (p: predicted routing probabilities), B the rows verified in the pass (1 for
one sequence; a batch's B rows share one pass, one t and one set of loaded experts) and T the
tokens the pass computes (B times the widest row: rows are padded). The controller maximises the
step's throughput (B + V(S)) / (d(S) + t(S)).

A step makes two decisions with these prices (`grow_forest` serves both from one growth):
- what to draft next: the set S* of best (B + V) / (d + t), its draft time priced by the depth it
  needs (`ForestGrowth.sized`); its rate r* = (B + V(S*)) / (d(S*) + t(S*)) is what a well-sized
  step makes of a millisecond;
- what to verify of the candidates already drafted: their drafting is spent whatever is verified,
  so S maximises V(S) - r* t(S) (`ForestGrowth.verified_when_drafted`): a node is verified when its
  value pays for its verify time at the rate steps make. Pricing the spent drafting in (sizing's
  objective) discards drafted nodes that would pay; maximising this step's own ratio with the spent
  time in the denominator favours larger sets the more was spent, and the next candidate tree,
  sized from them, would grow again.

Adding node j raises the value by v_j and the time by the experts it adds that S does not load
yet, sum_l per_expert_ms[l] * sum_e p_{l,j,e} * prod_{i in S} (1 - p_{l,i,e}), plus B tokens if
it widens the pass and depth_ms if it is deeper than S. `grow_forest` grows S from the
roots, each time adding the frontier node with the best marginal value per marginal millisecond,
over the whole trees at once (no per-depth top-k), and keeps what each set along the way is worth;
unlike stopping at the first node that does not pay, this also finds sets where a node only pays
together with its children.

Offloaded experts (`moe_spec.offload`): given the cache's residency r_{l,e} at decision time (exact)
and the profile's fetch cost m_l (`profile/fetch_cost.py`), an expert that is not resident also costs
its fetch. The pass's roots alone already miss M0_l = sum_e (1 - r_{l,e}) P(a root loads e) experts
per layer, so each further missing expert is priced at the fetch cost's mean slope over the next K
misses after M0_l (K: experts per token), and resident experts at their compute cost alone: a node
whose experts are all resident is nearly free, one that touches cold experts pays for every read.
Once a layer's expected distinct experts fill its C resident slots, every further expert is streamed
through scratch slots and costs the fetch cost's overflow price o more (`FetchCost.overflow_ms`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from moe_spec.profile.cost_model import CostModel
from moe_spec.core.forest import StepForest
from moe_spec.core.tree import DraftTree
from moe_spec.policy.row_growth import ExpertSets, SetPricer, flat_expert_sets, grow_rows


@dataclass(frozen=True)
class StepPrices:
    """What the controller knows about one candidate tree."""

    values: torch.Tensor | Sequence[float]  # [N]: calibrated P(node on the accepted path); root's entry is ignored
    expert_probs: torch.Tensor | None  # [L, N, E] predicted routing probabilities; None: dense or not priced
    # the same routing as flat id sets (0/1 routing of one row), standing in for expert_probs where
    # only the growth in plain Python reads it (`row_growth`); None: derived from expert_probs when needed
    expert_sets: ExpertSets | None = None

    @property
    def priced(self) -> bool:
        """The nodes' experts are priced."""
        return self.expert_probs is not None or self.expert_sets is not None


def _value_list(prices: StepPrices) -> list[float]:
    """A tree's `values` as Python floats."""
    values = prices.values
    return values.tolist() if isinstance(values, (torch.Tensor, np.ndarray)) else list(values)


def throughput(value: float, draft_ms: float, verify_ms: float) -> float:
    """Expected tokens per ms of a step producing `value` tokens on average."""
    return value / max(draft_ms + verify_ms, 1e-9)


def subset_verify_ms(cost: CostModel, keep: list[int], expert_probs: torch.Tensor | None, rows: int = 1,
                     residency: torch.Tensor | None = None) -> float:
    """t(S) for node indices `keep` (every row's root included) of a pass over `rows` rows; with
    several rows, `keep` and expert_probs' N index the rows' nodes side by side. `residency` [L, E]
    bool: the experts resident now (offloaded experts), so that the others are priced as fetches."""
    if expert_probs is None or cost.num_layers == 0:
        return cost.fixed_ms(rows) + cost.per_token_ms * len(keep)
    probs = expert_probs[:, keep].double()  # [L, |S|, E]
    loaded = 1.0 - torch.prod(1.0 - probs, dim=1)  # [L, E] P(the pass loads expert e of layer l)
    misses = (loaded * (~residency).double()).sum(-1).numpy() if residency is not None else None  # [L]
    return cost.predict_ms(len(keep), loaded.sum(-1), rows, misses=misses)


def subset_objective(cost: CostModel, tree: DraftTree, prices: StepPrices, keep: list[int], depth_ms: float = 0.0) -> float:
    """Throughput of verifying `keep` of one tree, drafted to the depth it reaches."""
    values = _value_list(prices)
    value = 1.0 + sum(values[k] for k in keep if k != 0)
    draft_ms = depth_ms * int(tree.depths[keep].max())
    return throughput(value, draft_ms, subset_verify_ms(cost, keep, prices.expert_probs))


def best_first_subtree(tree: DraftTree, prices: StepPrices, cost: CostModel, depth_ms: float = 0.0,
                       max_nodes: int | None = None) -> list[int]:
    """Node indices (root first) of the subtree chosen by best-first growth; see module docstring."""
    return best_first_forest([tree], [prices], cost, depth_ms, max_nodes)[0]


class _ExpertPrices:
    """Each node's expected ms of the experts it would newly load, kept up to date as nodes are chosen.

    A chosen node lowers the chance that each expert it may load is still unloaded; every node's
    price is then the still-unloaded experts it may load, priced.
    """

    def __init__(self, forest: StepForest, prices: list[StepPrices], cost: CostModel, residency: torch.Tensor | None = None):
        self.row_probs = [p.expert_probs.double().numpy() for p in prices]  # each [L, N_b, E]
        num_layers, _, num_experts = self.row_probs[0].shape
        self.by_expert = np.concatenate([r.transpose(0, 2, 1) for r in self.row_probs], axis=2).reshape(-1, forest.num_nodes)  # [L*E, N]
        self.per_expert = np.repeat(np.asarray(cost.expert_weights(), dtype=np.float64), num_experts)  # [L*E] ms if new
        self.miss = np.prod([1.0 - r[:, 0] for r in self.row_probs], axis=0).reshape(-1)  # [L*E]: no chosen node loads it yet
        self.shape = (num_layers, num_experts)
        self.cold = None  # [L*E] 1.0 where the expert is not resident (offloaded experts, residency priced)
        self.overflow_ms, self.capacity = 0.0, None  # o and C: each expert beyond a layer's slots costs o more
        if residency is not None and cost.fetch is not None:
            self.cold = (~residency.reshape(-1).numpy()).astype(np.float64)
            per_token = max(1, round(float(self.row_probs[0][:, 0].sum(-1).mean())))  # K experts a token loads
            price = cost.fetch.miss_price(self.expected_misses(), added=per_token)  # [L] ms per further miss
            self.per_expert = self.per_expert + self.cold * np.repeat(price, num_experts)
            if cost.fetch.capacity is not None and cost.fetch.overflow_ms > 0:
                self.overflow_ms, self.capacity = cost.fetch.overflow_ms, cost.fetch.capacity
        self.within_slots = self.per_expert  # [L*E] ms per new expert while its layer's slots hold the pass
        if self.overflow_ms:
            self._price_overflow()
        self.node_ms = (self.miss * self.per_expert) @ self.by_expert  # [N]

    def _price_overflow(self) -> None:
        """Every new expert of a layer whose expected experts fill its C slots costs o more (one more
        expert streamed through the scratch slots), ramping in over the last expert before C."""
        full = np.clip(self.expected_unique() - self.capacity + 1.0, 0.0, 1.0)  # [L]
        self.per_expert = self.within_slots + np.repeat(self.overflow_ms * full, self.shape[1])

    def expected_unique(self) -> np.ndarray:
        """[L] expected distinct experts the chosen nodes (the roots at first) load."""
        return (1.0 - self.miss).reshape(self.shape).sum(-1)

    def expected_misses(self) -> np.ndarray | None:
        """[L] expected non-resident experts the chosen nodes load (None: residency not priced)."""
        if self.cold is None:
            return None
        return ((1.0 - self.miss) * self.cold).reshape(self.shape).sum(-1)

    def choose(self, node: int) -> None:
        """Flat node `node` is chosen: the experts it may load are less likely still unloaded, and
        every node's price is recomputed in place (one [L*E] x [L*E, N] product costs less than
        updating only the touched entries)."""
        self.miss *= 1.0 - self.by_expert[:, node]  # by_expert[:, node]: P(node loads expert e of layer l)
        if self.overflow_ms:
            self._price_overflow()
        np.matmul(self.miss * self.per_expert, self.by_expert, out=self.node_ms)


class ProbabilityPricer:
    """`row_growth.ExpertPricer` of routing probabilities (and residency, offloaded experts), on
    `_ExpertPrices`."""

    def __init__(self, experts: _ExpertPrices, cost: CostModel, rows: int):
        self.experts = experts
        self.frontier_nodes: dict[int, None] = {}  # in the order they entered
        self._roots_ms = cost.predict_ms(rows, experts.expected_unique(), rows=rows, misses=experts.expected_misses())

    def roots_pass_ms(self) -> float:
        return self._roots_ms

    def enter(self, node: int) -> None:
        self.frontier_nodes[node] = None

    def frontier(self):
        prices = self.experts.node_ms.tolist()  # one conversion per pick, not one per node
        return ((node, prices[node]) for node in self.frontier_nodes)

    def take(self, node: int) -> float:
        del self.frontier_nodes[node]
        ms = float(self.experts.node_ms[node])
        self.experts.choose(node)
        return ms


def best_first_forest(
    trees,
    prices: list[StepPrices],
    cost: CostModel,
    depth_ms: float,
    max_nodes: int | None = None,
    patience: int | None = None,
    draft_fixed_ms: float = 0.0,
    residency: torch.Tensor | None = None,
) -> list[list[int]]:
    """Each row's chosen node indices, root first: `grow_forest(...).sized()`."""
    return grow_forest(trees, prices, cost, depth_ms, max_nodes, patience, draft_fixed_ms, residency).sized()


@dataclass
class ForestGrowth:
    """What best-first growth saw: the nodes in the order it added them and, after each, the
    expected tokens and the predicted verify and draft times of the set so far (entry 0: the roots
    alone)."""

    forest: StepForest
    order: list[int]  # forest node indices, in the order growth added them
    # Python floats, not arrays: read a few at a time on every step's critical path
    value: tuple[float, ...]  # [K + 1] expected tokens of the first k added nodes (every row's bonus token included)
    verify_ms: tuple[float, ...]  # [K + 1] predicted verify time of those sets
    draft_ms: tuple[float, ...]  # [K + 1] the draft time their depth needs
    best_size: int  # nodes of the set of best (B + V) / (d + t): what drafting *and* verifying should aim at

    @property
    def best_rate(self) -> float:
        """Expected tokens per ms of the best set, its drafting priced."""
        return throughput(self.value[self.best_size], self.draft_ms[self.best_size], self.verify_ms[self.best_size])

    def sized_shape(self) -> tuple[int, int]:
        """(most nodes in one row, deepest depth) of the best set: what the next draft is sized
        from, without building its subtrees."""
        if not self.best_size:
            return 0, 0
        if self.forest.rows == 1:  # one row: its chosen nodes, as deep as the deepest
            depths = self.forest[0].depth_list
            return self.best_size, max(depths[node] for node in self.order[:self.best_size])
        chosen = np.asarray(self.order[:self.best_size], dtype=np.int64)
        return int(np.bincount(self.forest.row_of[chosen]).max()), int(self.forest.depths[chosen].max())

    def sized(self) -> list[list[int]]:
        """Each row's nodes (root first) of the best set, drafting priced: the size to draft next."""
        return self.rows_of(self.best_size)

    def verified_when_drafted(self, rate: float | None = None) -> list[list[int]]:
        """Each row's nodes (root first) to verify now that the candidates are drafted: their
        drafting is spent whatever is verified, so a node is worth its verify time alone. The step
        keeps the prefix of the growth order maximising V - rate * t, `rate` being what the decoder
        makes of a millisecond elsewhere (default: `best_rate`, the rate of the best-sized step).
        Maximising this step's own ratio instead, (B + V) / (d + t) with d spent, would verify more
        the more was spent on drafting, and the next candidate tree, sized from what is verified,
        would grow again."""
        return self.rows_of(self.verified_size(rate))

    def verified_size(self, rate: float | None = None) -> int:
        """How many nodes of the growth order `verified_when_drafted` keeps."""
        rate = self.best_rate if rate is None else rate
        # in plain Python (a few dozen entries, on every step's critical path); the first maximum: the smaller set
        gains = [value - rate * verify for value, verify in zip(self.value, self.verify_ms)]
        return max(gains.index(max(gains)), self.best_size)

    def rows_of(self, size: int) -> list[list[int]]:
        """Each row's nodes (root first) of the first `size` nodes of the growth order."""
        return [[0] + row for row in self.forest.local(self.order[:size])]


def grow_forest(
    trees,
    prices: list[StepPrices],
    cost: CostModel,
    depth_ms: float,
    max_nodes: int | None = None,
    patience: int | None = None,
    draft_fixed_ms: float = 0.0,
    residency: torch.Tensor | None = None,
) -> ForestGrowth:
    """Best-first growth over the B rows' trees (a `StepForest` or a list of trees) verified in one
    pass (B = 1: one sequence), as a `ForestGrowth`. Every row's root is mandatory, all rows share one verify time, and
    a node's expert price counts only experts that no chosen node of *any* row loads yet.

    The pass is padded (`StepForest.width`): it computes B * W tokens, W the widest row's size, and
    padding loads no expert. So a node in a row narrower than W fills a slot the pass computes
    anyway and costs only the experts it adds, while a node in a row at width W widens the pass by
    B tokens. A node deeper than every chosen node also costs the draft time of that depth
    (`depth_ms`, drafting all rows one level deeper): the time a step spends on drafting is priced
    by the depth the chosen trees need (plus `draft_fixed_ms` once any node is chosen), never taken
    as already spent (`residency` [L, E] bool: the resident experts, priced as the module docstring says), so a large candidate tree does not talk the controller into verifying more of
    it. Growth adds the frontier node of best value per marginal millisecond under these prices
    (free-slot nodes only while they raise the throughput by themselves), and returns the best set
    seen along the way; growth stops `patience` nodes after the last improvement (default 11 + B,
    so a new width can be filled across the rows). With one row every node widens the pass, which
    is plain best-first growth by marginal value per marginal time.

    The loop is `row_growth.grow_rows`, in plain Python on the critical path of every decoding
    step; the experts' prices come from a `row_growth.SetPricer` (0/1 routing without residency,
    the common case) or a `ProbabilityPricer` (probabilities, residency).
    """
    forest = StepForest.of(trees)
    n, batch = forest.num_nodes, forest.rows
    limit = n - batch if max_nodes is None else min(max_nodes, n - batch)
    patience = 11 + batch if patience is None else patience
    if forest.rows == 1:  # its flat indices are the tree's own
        tree = forest[0]
        values, parents, depths, row_of = _value_list(prices[0]), tree.parent_list, tree.depth_list, [0] * len(tree)
    else:
        values = [value for p in prices for value in _value_list(p)]
        parents, depths, row_of = forest.parents.tolist(), forest.depths.tolist(), forest.row_of.tolist()
    pricer = _set_pricer(forest, prices, cost) if residency is None else None
    if pricer is None:
        pricer = _probability_pricer(forest, prices, cost, residency)
    order, value, verify_ms, draft_ms, best_size = grow_rows(
        values, parents, depths, row_of, batch, pricer, cost.per_token_ms, depth_ms, draft_fixed_ms, limit, patience)
    return ForestGrowth(forest, order, tuple(value), tuple(verify_ms), tuple(draft_ms), best_size)


def _set_pricer(forest: StepForest, prices: list[StepPrices], cost: CostModel) -> SetPricer | None:
    """The rows' routing as bit masks (each `expert_sets`, or derived from 0/1 `expert_probs`), or
    no routing priced; None when some row's routing is priced as probabilities (not 0/1 sets) or
    only some rows' experts are priced, which `ProbabilityPricer` handles."""
    priced = cost.num_layers > 0 and all(p.priced for p in prices)
    if cost.num_layers > 0 and not priced and any(p.priced for p in prices):
        return None
    masks, num_experts = None, 0
    if priced:
        per_row = [p.expert_sets if p.expert_sets is not None else flat_expert_sets(p.expert_probs) for p in prices]
        if any(row is None for row in per_row) or len({row.num_experts for row in per_row}) > 1:
            return None
        masks = per_row[0].masks if len(per_row) == 1 else [mask for row in per_row for mask in row.masks]
        num_experts = per_row[0].num_experts
    per_expert = list(cost.per_expert_ms)  # [L] ms per new expert of each layer (one value: shared by all)
    expert_ms = (per_expert * cost.num_layers if len(per_expert) == 1 else per_expert) if priced else []
    roots = list(forest.row_starts[:-1])  # each row's root, in flat indices
    return SetPricer(masks, expert_ms, num_experts, roots, cost.fixed_ms(forest.rows), cost.per_token_ms)


def _probability_pricer(forest: StepForest, prices: list[StepPrices], cost: CostModel,
                        residency: torch.Tensor | None) -> ProbabilityPricer | SetPricer:
    """Routing probabilities (and residency) priced in numpy; where some row's experts are not
    priced, none are (a `SetPricer` of no routing)."""
    if any(p.expert_probs is None and p.expert_sets is not None for p in prices):
        raise ValueError("expert_sets stand in for expert_probs in growth without residency only; "
                         "pass expert_probs with residency")
    if cost.num_layers > 0 and all(p.expert_probs is not None for p in prices):
        return ProbabilityPricer(_ExpertPrices(forest, prices, cost, residency), cost, forest.rows)
    return SetPricer(None, [], 0, list(forest.row_starts[:-1]), cost.fixed_ms(forest.rows), cost.per_token_ms)


def best_prefix_by_score(tree: DraftTree, values: torch.Tensor, verify_ms_for_tokens, draft_ms: float) -> list[int]:
    """The EVICT-style cut: order drafted nodes by draft score (EAGLE-2's rerank), keep the prefix
    with the highest expected tokens per ms under a cost that depends on the token count only.

    verify_ms_for_tokens: callable T -> ms for a verify pass of T tokens (root included).
    """
    scores = tree.scores[1:].numpy()
    order = np.lexsort((np.arange(1, len(tree)), -scores)) + 1  # by score, ties to the lower index
    expected = 1.0 + np.concatenate([[0.0], np.cumsum(values.double().numpy()[order])])  # [N]: prefix of size k
    verify = np.array([verify_ms_for_tokens(size + 1) for size in range(len(tree))])
    best = int(np.argmax(expected / np.maximum(draft_ms + verify, 1e-9)))  # first maximum: the smaller prefix
    return [0] + order[:best].tolist()
