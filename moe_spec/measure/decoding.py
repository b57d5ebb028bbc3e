"""The profiler's decoding: `SpecDecoder` itself, observed.

Every trace, calibration sample and routing statistic the profiler uses comes from the engine's
own loop through `TraceRecorder`, a `DecodeObserver` that keeps, per prompt, the sequence the
target saw (the prompt, then each step's accepted path: root and accepted drafts) with that
sequence's in-context routing, and the prompt's one-row `StepRecord`s (labels: see
`moe_spec.core.step_record`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from moe_spec.core.drafting import BatchDrafter, Drafter, TreeBudget
from moe_spec.core.engine import SpecDecoder
from moe_spec.core.step_record import DecodeObserver, PrefillRecord, StepRecord
from moe_spec.core.target import TargetModel
from moe_spec.core.sampling import GREEDY, SamplingConfig
from moe_spec.policy.candidate_scheme import CandidateScheme
from moe_spec.policy.static import StaticController


@dataclass(frozen=True)
class PromptTrace:
    prompt_index: int
    tokens: torch.Tensor  # [T] long: prompt then committed tokens (the sequence the target saw)
    experts: torch.Tensor  # [L, T, K] long: routing of those tokens in context ([0, T, 0] for a dense target)
    steps: tuple[StepRecord, ...]  # one-row records, in decoding order

    def context(self, step: StepRecord) -> torch.Tensor:
        """[P] the committed tokens `step` (one of `steps`) verified its tree on."""
        return self.tokens[: step.prefix_lens[0]]


@dataclass
class _RowTrace:
    tokens: list[torch.Tensor]  # each [n] long
    experts: list[torch.Tensor]  # each [L, n, K] long
    steps: list[StepRecord] = field(default_factory=list)


class TraceRecorder(DecodeObserver):
    """Collects a `PromptTrace` per row of the decoded batch (the caller's row index is the prompt's)."""

    def __init__(self, first_prompt_index: int = 0):
        self.first_prompt_index = first_prompt_index
        self._rows: dict[int, _RowTrace] = {}

    def on_prefill(self, record: PrefillRecord) -> None:
        for b, (row, prompt) in enumerate(zip(record.rows, record.prompts)):
            self._rows[row] = _RowTrace([prompt], [record.experts(b)])

    def on_step(self, record: StepRecord) -> None:
        for b, row in enumerate(record.rows):
            path = torch.tensor(record.acceptances[b].path)
            trace = self._rows[row]
            trace.tokens.append(record.tree(b).tokens[path])
            trace.experts.append(record.experts(b)[:, path])
            trace.steps.append(record.row(b))

    def traces(self) -> list[PromptTrace]:
        return [
            PromptTrace(self.first_prompt_index + row, torch.cat(t.tokens), torch.cat(t.experts, dim=1), tuple(t.steps))
            for row, t in sorted(self._rows.items())
        ]


def decode_prompts(
    target: TargetModel,
    drafter: Drafter | BatchDrafter | None,
    prompts: Sequence[torch.Tensor],  # each [T] long
    max_new_tokens: int,
    budget: TreeBudget | None = None,
    tick: Callable[[], None] = lambda: None,
    sampling: SamplingConfig = GREEDY,
    generator: torch.Generator | None = None,
) -> list[PromptTrace]:
    """Speculative decoding of each prompt on its own, `max_new_tokens` each (greedy unless
    `sampling` says otherwise; `generator` draws the samples).

    With `budget`, every step drafts to it (its candidate scheme included) and verifies its
    `max_nodes` best-scored nodes (`StaticController`); without, the drafter's default budget and
    the full candidate tree. EOS does not stop a prompt: every prompt contributes the same number
    of tokens.
    """
    controller = StaticController(budget, CandidateScheme.SAMPLED if budget.sampled else CandidateScheme.TOP) \
        if budget is not None else None
    traces = []
    for index, prompt in enumerate(prompts):
        recorder = TraceRecorder(first_prompt_index=index)
        decoder = SpecDecoder(target, drafter, controller, observer=recorder)
        decoder.generate(prompt[None], max_new_tokens=max_new_tokens, eos_token_id=[], temperature=sampling.temperature,
                         top_k=sampling.top_k, top_p=sampling.top_p, generator=generator)
        traces += recorder.traces()
        tick()
    return traces
