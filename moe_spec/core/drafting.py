"""What the engine asks of a drafter, and the budget a controller gives it.

The engine drafts every row of a batch in one call (`BatchDrafter`; a single prompt is a batch of
one). A drafter that batches its own work (`EagleDrafter`: one head forward per tree depth for all
rows) implements `BatchDrafter` itself; a simpler per-sequence `Drafter` (the lookup drafter) runs
one `spawn()`ed copy per row behind `PerRowDrafters`. Whichever it is, `batch_drafter` hands the
engine a `BudgetCheckedDrafter` around it: a tree larger or deeper than its budget is refused with
a `DrafterError` before the target sees it (a 10,000-node tree would otherwise become a
10,000 x 10,000 mask and an attention pass of that width).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from moe_spec.core.sampling import SamplingConfig
from moe_spec.core.tree import DraftTree
from moe_spec.errors import DrafterError, InputError


@dataclass(frozen=True)
class TreeBudget:
    """How large a candidate tree a drafter may build (EAGLE-2's defaults: 60 nodes, depth 5, top-10)."""

    max_nodes: int = 60  # drafted nodes, root excluded
    max_depth: int = 5
    branching: int = 10  # children expanded per node
    # when sampling: draw each node's children from the draft distribution (verified by recursive
    # rejection against it) instead of taking its top tokens; greedy decoding ignores it
    sampled: bool = False
    # carry each drafted node's parent head output on the tree (`DraftTree.node_features`), for a
    # controller that predicts routing from it; off by default: nothing is gathered
    node_features: bool = False
    # top candidates: what the controller says one more depth could be worth (`DraftPricer`); the
    # drafter expands only the nodes it calls worth expanding. None: every depth the budget allows
    pricer: "DraftPricer | None" = field(default=None, compare=False)

    def __post_init__(self):
        if self.max_nodes < 0 or self.max_depth < 0 or self.branching < 1:
            raise ValueError(f"invalid tree budget {self}")

    def capped(self, max_depth: int) -> "TreeBudget":
        return replace(self, max_depth=min(self.max_depth, max_depth))

    def with_nodes(self, max_nodes: int) -> "TreeBudget":
        """This budget's depth, branching and scheme with another node count (`static:N`)."""
        return replace(self, max_nodes=max_nodes)

    def with_scheme(self, sampled: bool) -> "TreeBudget":
        return replace(self, sampled=sampled)

    def with_node_features(self, wanted: bool) -> "TreeBudget":
        return self if self.node_features == wanted else replace(self, node_features=wanted)

    @property
    def drafts_nothing(self) -> bool:
        return self.max_nodes == 0 or self.max_depth == 0


class DraftPricer(Protocol):
    """What a controller tells a drafter of top candidates about the worth of drafting deeper
    (`TreeBudget.pricer`). The drafter carries an opaque value per node, each node's from its
    parent's (`child_values`, once per head forward: `forwards` counts them), and before each
    further depth drafts only the rows `worth_expanding` names, so it stops where nothing deeper
    could pay for its drafting and verification. A stop changes which candidates
    exist, never how they are verified: the output is unchanged."""

    forwards: int  # head forwards run with this pricer (one per `child_values` call)

    def child_values(self, depth: int, parent_values: list[list[float]], log_q: list[list[list[float]]]) -> list[list[float]]:
        """parent_values [B][M] of the nodes a head forward expanded; log_q [B][M][w] their children's
        draft log-probabilities in rank order (slot 0: the top child) -> [B][M*w] the children's
        values (children at `depth`; parent m's in slots m*w ... m*w + w - 1). Python lists: a few
        dozen values a depth."""

    def worth_expanding(self, depth: int, values: list[list[float]]) -> list[bool]:
        """values [B][M] of frontier nodes (at depth - 1; 0: no node) -> [B]: drafting row b's next
        depth (`depth`) could pay."""


EAGLE2_BUDGET = TreeBudget(max_nodes=60, max_depth=5, branching=10)  # EAGLE-2's published default, defined once
NO_DRAFT = TreeBudget(0, 0, 1)  # a plain autoregressive step


class Drafter(Protocol):
    """A per-sequence drafter: proposes draft trees for one row and learns what the target committed.

    The engine calls `begin` once after prefill, then per step `propose` (a tree rooted at the
    pending token, whose key/value is not yet in the target's cache) and `commit` (the tokens the
    step wrote into the target's cache: the root and the accepted drafts, with their target
    features). `spawn` gives a fresh copy for another row of a batch.

    Budgets nest: from the same state, a budget of k nodes proposes the k best-scored nodes (ties:
    the lower index) of what a budget of more nodes and the same depth and branching proposes, so
    what a step verifying N nodes accepted tells what any smaller fixed budget would have
    (`moe_spec.policy.fewer_nodes`).
    """

    default_budget: TreeBudget

    def begin(self, prompt: torch.Tensor, features: torch.Tensor) -> None:
        """prompt: [T] long; features: [T, S, D] target hidden states of the prompt tokens."""

    def propose(self, root_token: int, budget: TreeBudget, sampling: SamplingConfig) -> DraftTree:
        """A draft tree whose node 0 holds `root_token`."""

    def commit(self, tokens: torch.Tensor, features: torch.Tensor) -> None:
        """tokens: [A] long now in the target's cache; features: [A, S, D] their hidden states."""

    def spawn(self) -> "Drafter":
        """A fresh drafter sharing this one's weights and settings, for another row of a batch."""


class BatchDrafter(Protocol):
    """What the engine talks to: a drafter for B rows at once; lists hold one entry per row."""

    default_budget: TreeBudget

    def begin(self, prompts: Sequence[torch.Tensor], features: Sequence[torch.Tensor]) -> None:
        """prompts[b]: [T_b] long; features[b]: [T_b, S, D]."""

    def propose(self, roots: Sequence[int], budget: TreeBudget, max_depths: Sequence[int],
                sampling: SamplingConfig, generator: torch.Generator | None = None) -> list[DraftTree]:
        """Row b's tree rooted at roots[b], at most max_depths[b] deep (0: the root alone);
        `generator` draws sampled candidates (`budget.sampled`, when sampling)."""

    def commit(self, tokens: Sequence[torch.Tensor], features: Sequence[torch.Tensor]) -> None:
        """tokens[b]: [A_b] long now in the target's cache; features[b]: [A_b, S, D]."""

    def keep_rows(self, rows: Sequence[int]) -> None:
        """Drop every row not listed (finished rows leave the batch); the order is kept."""


class PerRowDrafters:
    """`BatchDrafter` over one per-sequence `Drafter` per row, called row by row."""

    def __init__(self, drafters: Sequence[Drafter]):
        self.drafters = list(drafters)
        self.default_budget = self.drafters[0].default_budget

    def begin(self, prompts, features) -> None:
        for drafter, prompt, feature in zip(self.drafters, prompts, features):
            drafter.begin(prompt, feature)

    def propose(self, roots, budget, max_depths, sampling, generator=None) -> list[DraftTree]:
        # per-sequence drafters propose deterministic candidates: they draw nothing
        return [
            drafter.propose(root, budget.capped(depth), sampling) if depth > 0 else DraftTree.root_only(root)
            for drafter, root, depth in zip(self.drafters, roots, max_depths)
        ]

    def commit(self, tokens, features) -> None:
        for drafter, token, feature in zip(self.drafters, tokens, features):
            drafter.commit(token, feature)

    def keep_rows(self, rows) -> None:
        self.drafters = [self.drafters[i] for i in rows]


class BudgetCheckedDrafter:
    """A `BatchDrafter` whose every proposal is checked against what it was asked for: one tree per
    row, each a `DraftTree` of at most `budget.max_nodes` drafted nodes and at most
    `min(budget.max_depth, max_depths[b])` deep (0 for a row that may not draft)."""

    def __init__(self, inner: BatchDrafter, name: str):
        self.inner = inner
        self.name = name  # the drafter's class, for messages
        self.default_budget = inner.default_budget

    def begin(self, prompts, features) -> None:
        self.inner.begin(prompts, features)

    def propose(self, roots, budget, max_depths, sampling, generator=None) -> list[DraftTree]:
        trees = self.inner.propose(roots, budget, max_depths, sampling, generator=generator)
        check_proposal(self.name, trees, len(roots), budget, max_depths)
        return trees

    def commit(self, tokens, features) -> None:
        self.inner.commit(tokens, features)

    def keep_rows(self, rows) -> None:
        self.inner.keep_rows(rows)


def check_proposal(name: str, trees, rows: int, budget: TreeBudget, max_depths: Sequence[int]) -> None:
    """Raise `DrafterError` unless `trees` holds `rows` draft trees within `budget` and `max_depths`.
    The node count is checked first, in O(1) per tree, so an oversized tree is refused before its
    depths are computed."""
    if not isinstance(trees, (list, tuple)) or len(trees) != rows:
        got = f"{len(trees)} trees" if isinstance(trees, (list, tuple)) else f"a {type(trees).__name__}"
        raise DrafterError(f"drafter {name} returned {got} for a batch of {rows} rows")
    for row, (tree, depth) in enumerate(zip(trees, max_depths)):
        if not isinstance(tree, DraftTree):
            raise DrafterError(f"drafter {name} returned a {type(tree).__name__} for row {row}, not a DraftTree")
        if tree.num_drafted > budget.max_nodes:
            raise DrafterError(f"drafter {name} proposed {tree.num_drafted} drafted nodes for row {row}, over its "
                               f"budget of {budget.max_nodes}")
        allowed = max(0, min(budget.max_depth, int(depth)))
        deepest = int(tree.depths.max())
        if deepest > allowed:
            raise DrafterError(f"drafter {name} proposed a tree {deepest} deep for row {row}, over the {allowed} "
                               f"it was allowed (budget depth {budget.max_depth}, row limit {int(depth)})")


def batch_drafter(drafter, batch: int) -> BatchDrafter:
    """The drafter for `batch` rows, its proposals checked (`BudgetCheckedDrafter`): the drafter
    itself when it drafts a batch (it has `keep_rows`, as `EagleDrafter` does, for any batch size),
    else copies of it per row."""
    name = type(drafter).__name__
    if isinstance(drafter, BudgetCheckedDrafter):
        return drafter
    if hasattr(drafter, "keep_rows"):
        return BudgetCheckedDrafter(drafter, name)
    if batch == 1:
        return BudgetCheckedDrafter(PerRowDrafters([drafter]), name)
    spawn = getattr(drafter, "spawn", None)
    if spawn is None:
        raise InputError(f"{name} cannot draft for a batch (it has no spawn()); pass one prompt")
    return BudgetCheckedDrafter(PerRowDrafters([drafter] + [spawn() for _ in range(batch - 1)]), name)
