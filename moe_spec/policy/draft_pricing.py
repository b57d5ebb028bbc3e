"""`DepthPricer`: the moe-aware controller's say in how deep each step's drafting goes.

The candidate tree of top tokens is sized from the last few steps' choices (`moe_aware`), so on a
step where the head is unsure the drafter would still run every depth recent steps used, and the
controller would then verify nothing of the deepest levels: their head forwards are spent for
nothing. Through `TreeBudget.pricer` the drafter now asks before each further depth whether anything
there could pay, with the controller's own prices:

- each drafted node carries its calibrated path product (the controller's maps, first children
  apart from later siblings, as `ProfiledController._calibrated` computes it), grown node by node
  with the tree; times the online acceptance correction of its depth (capped at 1) it bounds v, the
  node's P(on the accepted path) as the controller will value it;
- a frontier node's children together are worth at most v c_d (at most one of them lies on the
  accepted path, and none is accepted given its parent more often than c_d, the calibration's
  largest conditional acceptance at that depth) and each costs at least `node_ms` to verify, so
  they can add at most max(0, v c_d / rate - node_ms) ms worth of tokens, `rate` being the tokens
  a millisecond of a step makes;
- one more depth costs `depth_ms` of drafting for the whole batch. A row stops where its frontier can
  add nothing; every row stops where the frontiers together cannot pay for the depth.

It applies to top candidates only: a sampled tree's shape is its budget's. (Stopping a sampled
chain by values from its proxy scores, known before each draw, would be lossless too; tried with
these prices, such chains accepted less per node than a fixed chain of 3 at T = 1.) For top
candidates it is a bound, not an estimate: a level it stops is one the controller's growth could
not verify at a profit at these prices, so it only cuts drafting that was waste. The output is unchanged
either way: the pricer decides which candidates exist, never how they are verified.

It runs in plain Python: a depth carries a few dozen values (B rows, M expanded nodes, w children
each), where each numpy call, with the caches just evicted by a head forward, cost more than its
arithmetic (numpy: 0.56 / 0.64 / 0.60 ms of a 4-deep draft at B = 1 / 4 / 16,
`scripts/draft_overhead.py`).
"""

from __future__ import annotations

import math
from collections.abc import Callable


class DepthPricer:
    """A `moe_spec.core.drafting.DraftPricer` for one candidate tree (a fresh one per budget):
    `forwards` counts the head forwards drafting ran with it, what the controller's draft-cost
    tracker fits its per-depth time to."""

    def __init__(self, calibration, factor: Callable[[int], float], rate: float, node_ms: float, depth_ms: float):
        if rate <= 0 or node_ms < 0 or depth_ms < 0:
            raise ValueError(f"a depth pricer needs rate > 0 and non-negative costs, got rate {rate}, "
                             f"node_ms {node_ms}, depth_ms {depth_ms}")
        self.calibration = calibration  # `AcceptanceCalibration` of the request
        self.factor = factor  # depth -> the online acceptance correction's factor
        self.rate = rate  # tokens per ms a step makes
        self.node_ms = node_ms  # the least a verified node costs
        self.depth_ms = depth_ms  # one head forward over every row
        self.forwards = 0
        self._maps: dict[int, tuple[Callable[[float], float], Callable[[float], float]]] = {}  # depth -> (later, first)

    def child_values(self, depth: int, parent_values: list[list[float]], log_q: list[list[list[float]]]) -> list[list[float]]:
        """parent_values [B][M] path products; log_q [B][M][w] the children's log q in rank order ->
        [B][M*w] their calibrated path products (children at `depth`; parent m's at m*w ... m*w + w - 1)."""
        self.forwards += 1
        later, first = self._maps_at(depth)
        exp = math.exp
        out = []
        for parents, children_of in zip(parent_values, log_q):
            row: list[float] = []
            for value, children in zip(parents, children_of):
                if value <= 0.0:  # no node (a placeholder, or a stopped row): nor its children
                    row += [0.0] * len(children)
                    continue
                row.append(value * first(exp(children[0])))  # each parent's first child
                row += [value * later(exp(child)) for child in children[1:]]  # later siblings
            out.append(row)
        return out

    def worth_expanding(self, depth: int, values: list[list[float]]) -> list[bool]:
        """values [B][M] path products of frontier nodes at depth - 1 (0: no node) -> [B]: whether
        drafting row b's next depth could pay."""
        factor = self.factor(depth - 1)
        best = self._best_conditional(depth)  # their children's together, at most
        rate, node_ms = self.rate, self.node_ms
        surplus = []  # [B] ms worth of tokens at most
        for row in values:
            total = 0.0
            for value in row:
                if value > 0.0:
                    gain = min(value * factor, 1.0) * best / rate - node_ms  # at least what the controller values them at
                    if gain > 0.0:
                        total += gain
            surplus.append(total)
        enough = sum(surplus) > self.depth_ms
        return [enough and row > 0.0 for row in surplus]

    def _maps_at(self, depth: int) -> tuple[Callable[[float], float], Callable[[float], float]]:
        """(later siblings', first child's) calibrated conditional acceptance at `depth`, as functions of q."""
        if depth not in self._maps:
            calibration = self.calibration
            self._maps[depth] = (calibration.conditional_map(depth).at, calibration.conditional_map(depth, True).at)
        return self._maps[depth]

    def _best_conditional(self, depth: int) -> float:
        """The most a child at `depth` is accepted given its parent, by the calibration (its maps
        are non-decreasing in q, so at q = 1): no more than one child is accepted, so the children
        of a node of value v are together worth at most v times this."""
        later, first = self._maps_at(depth)
        return min(1.0, max(later(1.0), first(1.0)))
