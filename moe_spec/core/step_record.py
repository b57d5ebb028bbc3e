"""What one decoding step did, as data: for controllers (`Controller.observe`), observers, the
profiler and traces. One record type for all of them, so everything learnt from decoding is
learnt from the loop that decodes.

Labels, greedy (used by calibration):
- a node is *on the accepted path* when it and all its ancestors were accepted;
- a node is *conditionally accepted* when its token equals the target's argmax at its parent.
  The target's logits at a node are computed over that node's own root path (tree mask), so the
  label is defined for every verified node, reached or not; a node is on the accepted path iff
  every node on its path (root excluded) is conditionally accepted.

Labels, sampling: a node's *acceptance probability* is the exact chance that recursive rejection
accepts it once its parent is reached (`moe_spec.core.acceptance.conditional_acceptance`),
computed from the target's logits the record keeps for the purpose; under greedy decoding it is
the 0/1 conditional acceptance above.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from moe_spec.core.acceptance import Acceptance, conditional_acceptance
from moe_spec.core.forest import StepForest
from moe_spec.core.routing import Routing
from moe_spec.core.target import FetchCounts
from moe_spec.core.sampling import GREEDY, SamplingConfig
from moe_spec.core.tree import DraftTree


@dataclass(frozen=True)
class PrefillRecord:
    """The prompts as the target prefilled them."""

    rows: tuple[int, ...]  # the caller's batch index of each row
    prompts: tuple[torch.Tensor, ...]  # each [T_b] long, padding removed
    routing: Routing  # experts [L, B*T, K] of the left-padded pass
    valid: torch.Tensor  # [B, T] bool: the columns holding real tokens

    def experts(self, row: int) -> torch.Tensor:
        """[L, T_b, K] routing of row `row`'s prompt tokens (empty [0, T_b, 0] for a dense target)."""
        if not self.routing.layers:
            return torch.zeros(0, int(self.valid[row].sum()), 0, dtype=torch.long)
        width = self.valid.shape[1]
        columns = row * width + self.valid[row].nonzero().flatten()
        return self.routing.experts[:, columns]


@dataclass(frozen=True)
class StepRecord:
    rows: tuple[int, ...]  # the caller's batch index of each row in the pass
    prefix_lens: tuple[int, ...]  # committed tokens of each row before the step (its root's position)
    candidates: tuple[DraftTree, ...]  # per row, what the drafter proposed (root alone: not drafted)
    verified: StepForest  # per row, the subtree that went through the target
    acceptances: tuple[Acceptance, ...]
    argmax: torch.Tensor  # [B, W] long: the target's argmax at each slot of the pass (W = verified.width)
    routing: Routing  # experts [L, B*W, K] of the pass, padding slots included
    verify_ms: float  # the target forward
    draft_ms: float  # the drafter's proposal
    plan_ms: float = 0.0  # the controller's plan
    sampling: SamplingConfig = GREEDY  # the request's
    logits: torch.Tensor | None = None  # [B, W, V] the pass's logits, kept when sampling (acceptance probabilities)
    acceptance_probs: torch.Tensor | None = None  # [B, W] float64, when computed already (one-row records)
    fetch: FetchCounts | None = None  # offloaded experts: what the pass read, all rows together (None: not offloaded)
    accept_ms: float = 0.0  # after the pass, before this record: acceptance, the cache's and the drafter's update
    # perf_counter() seconds when the step began to draft (None: not timed), so that a controller can
    # price the whole step, up to the next one's start: its own observe and the loop's bookkeeping too
    started: float | None = None

    @property
    def batch(self) -> int:
        return len(self.rows)

    @property
    def step_ms(self) -> float:
        """What the step cost from drafting to acceptance (what controllers judge a step by)."""
        return self.draft_ms + self.plan_ms + self.verify_ms + self.accept_ms

    @property
    def tokens_produced(self) -> int:
        """Accepted drafts plus one bonus token per row."""
        return sum(a.num_accepted + 1 for a in self.acceptances)

    @property
    def speculated(self) -> bool:
        return self.verified.num_drafted > 0

    def tree(self, row: int = 0) -> DraftTree:
        return self.verified[row]

    def experts(self, row: int = 0) -> torch.Tensor:
        """[L, N_b, K] routing of row `row`'s verified nodes."""
        if not self.routing.layers:
            return torch.zeros(0, len(self.verified[row]), 0, dtype=torch.long)
        start = row * self.verified.width
        return self.routing.experts[:, start: start + len(self.verified[row])]

    def node_argmax(self, row: int = 0) -> torch.Tensor:
        """[N_b] the target's argmax at each of row `row`'s verified nodes."""
        return self.argmax[row, : len(self.verified[row])]

    def on_path(self, row: int = 0) -> torch.Tensor:
        """[N_b] bool: the node lies on the accepted path (root: True)."""
        labels = torch.zeros(len(self.verified[row]), dtype=torch.bool)
        labels[self.acceptances[row].path] = True
        return labels

    def conditional_accepted(self, row: int = 0) -> torch.Tensor:
        """[N_b] bool: the node's token equals the target's argmax at its parent (root: True)."""
        tree = self.verified[row]
        labels = tree.tokens == self.node_argmax(row)[tree.parents.clamp(min=0)]
        labels[0] = True
        return labels

    def acceptance_probability(self, row: int = 0) -> torch.Tensor:
        """[N_b] float64: P(node accepted | parent reached), exact (root 1); see the module docstring.
        A sampling record without logits (an old trace) falls back to the greedy label."""
        n = len(self.verified[row])
        if self.acceptance_probs is not None:
            return self.acceptance_probs[row, :n]
        if self.sampling.greedy or self.logits is None:
            return self.conditional_accepted(row).double()
        return conditional_acceptance(self.verified[row], self.logits[row, :n], self.sampling)

    def row(self, row: int) -> "StepRecord":
        """Row `row` alone, as a one-row record (what a trace file stores per line)."""
        probs = None
        if not self.sampling.greedy and self.logits is not None:  # computed now: the logits are not kept
            probs = self.acceptance_probability(row)[None]
        if self.batch == 1:
            return self if probs is None else replace(self, logits=None, acceptance_probs=probs)
        tree = self.verified[row]
        experts = self.experts(row)
        routing = Routing(self.routing.layers, self.routing.num_experts, experts) if self.routing.layers else self.routing
        return StepRecord(
            (self.rows[row],), (self.prefix_lens[row],), (self.candidates[row],), StepForest((tree,)),
            (self.acceptances[row],), self.node_argmax(row)[None], routing, self.verify_ms, self.draft_ms, self.plan_ms,
            self.sampling, None, probs, accept_ms=self.accept_ms,
        )


class DecodeObserver:
    """Receives the records of a `SpecDecoder.generate` call; override what you need.

    Observers only read: the records hold the engine's tensors, which must not be modified.
    """

    def on_prefill(self, record: PrefillRecord) -> None:
        pass

    def on_step(self, record: StepRecord) -> None:
        pass
