"""Best-first growth: one loop over the frontier, in plain Python, with a pluggable expert pricer.

The controller plans a step on a few dozen nodes a row, where numpy's cost is its calls, not its
arithmetic: some 120 calls a step, each two to three times slower than in a loop of its own,
because the target's forward between two steps evicts the interpreter's and numpy's working set
from the caches (a one-row plan measured 0.75 ms replayed back to back and 1.25 ms inside
decoding; a 16-row plan 3.9 ms inside decoding with a vectorised growth, 3.0 with this loop). So
the growth (`grow_rows`, the algorithm of `selection.grow_forest`) walks the frontier in Python,
and the price of the experts a frontier node would newly load comes from a pricer:

- `SetPricer`: 0/1 routing (what the head routing predictor and the token table's top-K give) as
  bit masks of (layer, expert) ids; choosing a node lowers the price of every frontier node
  sharing its new ids. Masks instead of frozensets of ids: replayed 16-row growths 0.75 -> 0.47 ms,
  one-row growths 0.058 -> 0.021 ms, the same orders. A lazy heap instead of the scan of the
  frontier per pick was measured no faster (a pick's new experts touch about half the frontier's
  prices).
- `selection.ProbabilityPricer`: routing probabilities and the offload cache's residency, in numpy
  (every node's price is one product per pick).
"""

from __future__ import annotations

from itertools import accumulate
from typing import NamedTuple, Protocol

import numpy as np

from moe_spec.profile.expert_masks import ids_of_mask, masks_of_bits

class ExpertSets(NamedTuple):
    """Each node's predicted experts as a bit mask over flat (layer * E + expert) ids (bit x set:
    the node loads flat id x): 0/1 routing in the form the growth in plain Python reads
    (`ProfiledController._expert_sets` predicts it without a one-hot). A mask's union, difference
    and count are single integer operations, where a set's cost grows with its L * K members."""

    masks: list[int]  # per node
    num_experts: int  # E: flat id x is expert x % E of layer x // E

    def split(self, sizes: list[int]) -> list["ExpertSets"]:
        """A forest's flat sets, one `ExpertSets` per row of `sizes` nodes."""
        if len(sizes) == 1:
            return [self]
        bounds = [0, *accumulate(sizes)]
        return [ExpertSets(self.masks[start:end], self.num_experts) for start, end in zip(bounds, bounds[1:])]

    def ids(self) -> list[frozenset[int]]:
        """Each node's flat ids as a set (for reading; the growth works on the masks)."""
        return [ids_of_mask(mask) for mask in self.masks]


def flat_expert_sets(expert_probs) -> ExpertSets | None:
    """[L, N, E] 0/1 predicted routing (torch or numpy) -> its `ExpertSets`; None when the routing
    is not 0/1 sets of one size per node (priced as probabilities: the vectorised growth handles
    those)."""
    probs = np.asarray(expert_probs)
    layers, nodes, experts = probs.shape
    flat = probs.transpose(1, 0, 2).reshape(nodes, layers * experts)  # [N, L*E]
    counts = np.count_nonzero(flat, axis=1)  # [N]
    per_node = int(counts[0]) if nodes else 0
    if not per_node or (counts != per_node).any() or float(flat.sum()) != per_node * nodes:  # ones only, K per layer
        return None
    return ExpertSets(masks_of_bits(flat != 0), experts)


class ExpertPricer(Protocol):
    """What `grow_rows` asks of the experts' prices. The pricer keeps the frontier's prices."""

    def roots_pass_ms(self) -> float:
        """The verify time of the roots alone (fixed, tokens and experts)."""

    def enter(self, node: int) -> None:
        """`node` joins the frontier."""

    def frontier(self):
        """(node, ms of the experts it would newly load) of every frontier node, in the order they entered."""

    def take(self, node: int) -> float:
        """`node` is chosen: it leaves the frontier; returns its price, and every other price drops by what it shares."""


class SetPricer:
    """`ExpertPricer` of 0/1 routing as bit masks (`ExpertSets`), or of no routing (`masks` None: dense
    or not priced, every node's experts free)."""

    def __init__(self, masks: list[int] | None, expert_ms: list[float], num_experts: int, roots: list[int],
                 roots_fixed_ms: float, per_token_ms: float):
        self.masks = masks
        # one price for every layer's experts (a shared per-expert cost): a node's price is that times
        # the count of its new ids; else each layer's count at that layer's price
        if expert_ms and min(expert_ms) == max(expert_ms):
            uniform = expert_ms[0]
            self._priced = lambda mask: uniform * mask.bit_count()
        else:
            layers = [(ms, ((1 << num_experts) - 1) << (layer * num_experts)) for layer, ms in enumerate(expert_ms)]
            self._priced = lambda mask: sum(ms * (mask & layer).bit_count() for ms, layer in layers)
        self.loaded = 0  # the (layer, expert) ids the chosen nodes load, as a mask
        for root in roots:
            self.loaded |= masks[root] if masks is not None else 0
        self._roots_ms = roots_fixed_ms + per_token_ms * len(roots) + (self._priced(self.loaded) if masks is not None else 0.0)
        self.price: dict[int, float] = {}  # frontier node -> ms of the experts it would newly load

    def roots_pass_ms(self) -> float:
        return self._roots_ms

    def enter(self, node: int) -> None:
        self.price[node] = self._priced(self.masks[node] & ~self.loaded) if self.masks is not None else 0.0

    def frontier(self):
        return self.price.items()

    def take(self, node: int) -> float:
        ms = self.price.pop(node)
        new = self.masks[node] & ~self.loaded if self.masks is not None else 0
        if new:
            self.loaded |= new
            for other in self.price:  # their shared new experts are loaded now
                shared = self.masks[other] & new
                if shared:
                    self.price[other] -= self._priced(shared)
        return ms


def grow_rows(values: list[float], parents: list[int], depths: list[int], row_of: list[int], rows: int,
              pricer: ExpertPricer, per_token_ms: float, depth_ms: float, draft_fixed_ms: float, limit: int,
              patience: int) -> tuple[list[int], list[float], list[float], list[float], int]:
    """Best-first growth over `rows` rows verified in one padded pass, their nodes flat (a root's
    parent is -1, `row_of` each node's row), the experts priced by `pricer`. Returns (order, value,
    verify_ms, draft_ms, best_size) as `selection.ForestGrowth` holds them, with the prices
    `selection.grow_forest` describes: a node in a row narrower than the pass fills a slot computed
    anyway (its experts only, and only while it raises the throughput by itself); otherwise it
    widens the pass by `rows` tokens. With one row every node widens it. Ties go to the lower index."""
    n = len(values)
    children: list[list[int]] = [[] for _ in range(n)]
    roots = []
    for node in range(n):
        if parents[node] < 0:
            roots.append(node)
        else:
            children[parents[node]].append(node)
    widen_ms = per_token_ms * rows  # a node widening the pass: a token more in every row
    for root in roots:
        for child in children[root]:
            pricer.enter(child)
    sizes, width = [1] * rows, 1  # nodes per row, roots included; the pass's width
    value, verify, deepest, draft = float(rows), pricer.roots_pass_ms(), 0, 0.0
    order: list[int] = []
    values_seen, verify_seen, draft_seen = [value], [verify], [draft]
    best_rate = rate = value / max(verify, 1e-9)
    best_size, stale = 0, 0
    max_depth, deepest_priced, deeper_at = max(depths), -1, []  # deeper_at[d]: a node at depth d's draft price past `deepest`
    while len(order) < limit and stale < patience:
        if deepest != deepest_priced:
            fixed = draft_fixed_ms if deepest == 0 else 0.0
            deeper_at = [depth_ms * max(d - deepest, 0) + fixed for d in range(max_depth + 1)]
            deepest_priced = deepest
        pick, pick_ratio, pick_fills = -1, 0.0, False
        for node, node_ms in pricer.frontier():
            value_of = values[node]
            if sizes[row_of[node]] < width:  # fills a slot the pass computes anyway
                marginal = node_ms + deeper_at[depths[node]]
                if not value_of > rate * marginal:  # such a node must raise the throughput itself
                    continue
                fills = True
            else:
                marginal = node_ms + widen_ms + deeper_at[depths[node]]
                fills = False
            ratio = value_of / (marginal if marginal > 1e-9 else 1e-9)
            if pick < 0 or ratio > pick_ratio or (ratio == pick_ratio and node < pick):
                pick, pick_ratio, pick_fills = node, ratio, fills
        if pick < 0:  # an empty frontier, or no node in it eligible
            break
        if not pick_fills:
            width += 1
            verify += widen_ms
        verify += pricer.take(pick)
        sizes[row_of[pick]] += 1
        deepest = max(deepest, depths[pick])
        draft = draft_fixed_ms + depth_ms * deepest
        value += values[pick]
        order.append(pick)
        for child in children[pick]:
            pricer.enter(child)
        stale += 1
        values_seen.append(value)
        verify_seen.append(verify)
        draft_seen.append(draft)
        rate = value / max(draft + verify, 1e-9)
        if rate > best_rate:
            best_rate, best_size, stale = rate, len(order), 0
    return order, values_seen, verify_seen, draft_seen, best_size
