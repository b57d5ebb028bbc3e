"""Verify passes timed inside the decode loop, at every size a controller verifies.

The latency sweep times each pass alone, repeated, with the weights evicted before it, and keeps
the minimum: that separates the cost of tokens from the cost of experts, but it is not what the
loop pays. In the loop a pass follows the drafter's work with the weights still warm, and the
throughput a controller maximises is made of mean times. On the embedded pair the sweep's model
priced plain steps 24% above what the loop measured and 60-node trees 11% below
(`scripts/price_check.py`), so a controller would see each added node as cheaper, against the
pass's fixed part, than it is. This stage decodes the profile's prompts verifying a best-first
prefix of the candidates whose size cycles through `LOOP_SIZES` (0: the root alone), and records
each step's pass as the loop timed it; `moe_spec.profile.loop_alignment` maps the sweep's model
onto them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from moe_spec.core.drafting import BatchDrafter, Drafter, TreeBudget
from moe_spec.core.engine import SpecDecoder
from moe_spec.core.forest import StepForest
from moe_spec.core.control import StepPlan
from moe_spec.core.sampling import GREEDY, SamplingConfig
from moe_spec.core.step_record import DecodeObserver, StepRecord
from moe_spec.core.target import TargetModel
from moe_spec.measure.routing_stats import best_first_order
from moe_spec.profile.cost_model import CostSample

LOOP_SIZES = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 60)  # drafted nodes verified, in turn


class SizeCycle:
    """A controller that drafts to `budget` every step and verifies the best-scored `sizes[i]`
    drafted nodes at its i-th step (cycling): one run covers every size, each under the loop's
    own conditions."""

    name = "size-cycle"

    def __init__(self, budget: TreeBudget, sizes: Sequence[int] = LOOP_SIZES):
        if not sizes or min(sizes) < 0:
            raise ValueError(f"sizes must be non-negative node counts, got {tuple(sizes)}")
        self.budget, self.sizes, self._step = budget, tuple(sizes), 0

    def begin(self, default: TreeBudget, sampling: SamplingConfig = GREEDY) -> TreeBudget:
        return self.budget

    def plan(self, candidates: StepForest, draft_ms: float = 0.0) -> StepPlan:
        size = self.sizes[self._step % len(self.sizes)]
        self._step += 1
        return StepPlan(StepForest(tuple(tree.subtree(best_first_order(tree)[: size + 1]) for tree in candidates)),
                        self.budget)

    def observe(self, record: StepRecord) -> None:
        pass


class _PassRecorder(DecodeObserver):
    def __init__(self):
        self.samples: list[CostSample] = []

    def on_step(self, record: StepRecord) -> None:
        self.samples.append(CostSample(record.verified.pass_tokens, tuple(record.routing.unique_per_layer()),
                                       record.verify_ms, rows=len(record.rows)))


@dataclass(frozen=True)
class LoopPasses:
    fit: tuple[CostSample, ...]  # passes of the fit prompts
    heldout: tuple[CostSample, ...]  # passes of the held-out prompts


def loop_passes(
    target: TargetModel,
    drafter: Drafter | BatchDrafter,
    prompts: Sequence[torch.Tensor],  # each [T] long
    held_out: frozenset[int],  # indices into prompts
    max_new_tokens: int,
    budget: TreeBudget | None = None,  # None: the drafter's default
    tick: Callable[[], None] = lambda: None,
) -> LoopPasses:
    """Each prompt decoded greedily on its own (one `SizeCycle` across all, so sizes keep turning
    from prompt to prompt), every step's verify pass recorded as the engine timed it."""
    controller = SizeCycle(budget or drafter.default_budget)
    fit, heldout = [], []
    for index, prompt in enumerate(prompts):
        recorder = _PassRecorder()
        SpecDecoder(target, drafter, controller, observer=recorder).generate(
            prompt[None], max_new_tokens=max_new_tokens, eos_token_id=[])
        (heldout if index in held_out else fit).extend(recorder.samples)
        tick()
    return LoopPasses(tuple(fit), tuple(heldout))
