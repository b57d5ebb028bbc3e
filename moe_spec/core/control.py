"""The controller protocol: how large a candidate tree to draft, and which part of it to verify.

Controllers see every row of a batch at once, because the rows share one verify pass: a row's
node is cheap when its experts are loaded for another row anyway. With one prompt the lists
have one entry.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from moe_spec.core.acceptance import Acceptance
from moe_spec.core.drafting import TreeBudget
from moe_spec.core.routing import Routing
from moe_spec.core.tree import DraftTree


class Controller(Protocol):
    def reset(self) -> None:
        """Called at the start of every `generate`."""

    def candidate_budget(self, default: TreeBudget) -> TreeBudget:
        """The budget the drafter expands its candidate trees to."""

    def select(self, candidates: Sequence[DraftTree], draft_ms: float) -> list[DraftTree]:
        """Per row, the subtree to verify: connected, containing the root (root alone: a plain AR
        step). draft_ms: what drafting the candidates cost (already spent)."""

    def feedback(
        self,
        verified: Sequence[DraftTree],
        acceptances: Sequence[Acceptance],
        verify_ms: float,
        draft_ms: float,
        routing: Sequence[Routing],
    ) -> None:
        """What the target accepted per row, and what the shared step cost."""
