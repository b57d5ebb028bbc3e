"""The drafter protocol and the budget a controller gives it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from moe_spec.sampling import SamplingConfig
from moe_spec.tree import DraftTree


@dataclass(frozen=True)
class TreeBudget:
    """How large a candidate tree a drafter may build (EAGLE-2's defaults: 60 nodes, depth 5, top-10)."""

    max_nodes: int = 60  # drafted nodes, root excluded
    max_depth: int = 5
    branching: int = 10  # children expanded per node

    def __post_init__(self):
        if self.max_nodes < 0 or self.max_depth < 0 or self.branching < 1:
            raise ValueError(f"invalid tree budget {self}")

    def capped(self, max_depth: int) -> "TreeBudget":
        return TreeBudget(self.max_nodes, min(self.max_depth, max_depth), self.branching)


class Drafter(Protocol):
    """Proposes draft trees and learns what the target committed.

    The engine calls `begin` once after prefill, then per step `propose` (a tree rooted at the
    pending token, whose key/value is not yet in the target's cache) and `commit` (the tokens the
    step wrote into the target's cache: the root and the accepted drafts, with their target
    features).
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
