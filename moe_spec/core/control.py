"""The controller protocol: which part of the drafted candidates to verify, and how large a
candidate tree to draft next.

Two calls per step and no state carried between them: `plan` sees the step's candidate trees and
returns a `StepPlan` (the subtrees to verify and the budget for the next step's candidates);
`observe` sees the `StepRecord` of what then happened. `begin` starts a `generate` call and gives
the first step's budget. Controllers see every row of a batch at once, because the rows share one
verify pass: a row's node is cheap when its experts are loaded for another row anyway.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from moe_spec.core.drafting import TreeBudget
from moe_spec.core.forest import StepForest
from moe_spec.core.sampling import SamplingConfig
from moe_spec.core.step_record import StepRecord


@dataclass(frozen=True)
class StepPlan:
    verify: StepForest  # per row, the subtree to verify: connected, containing the root (alone: a plain step)
    next_budget: TreeBudget  # the candidate tree the drafter expands to at the next step
    # () -> [L] expert ids each MoE layer is expected to need in the verify pass (the plan's
    # predicted routing), called only where the engine reads the ones not resident ahead of the
    # layers (experts offloaded with read-ahead on, `ExpertOffload.prefetch`). None: no prediction.
    expected_experts: Callable[[], tuple[tuple[int, ...], ...]] | None = None


class Controller(Protocol):
    def begin(self, default: TreeBudget, sampling: SamplingConfig) -> TreeBudget:
        """Called at the start of every `generate` with the drafter's default budget and the
        request's sampling settings; returns the first step's candidate budget."""

    def plan(self, candidates: StepForest, draft_ms: float) -> StepPlan:
        """Called every step, also when nothing was drafted (every candidate the root alone).
        draft_ms: what drafting the candidates cost (already spent)."""

    def observe(self, record: StepRecord) -> None:
        """What the step verified, accepted and cost."""
