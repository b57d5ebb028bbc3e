"""How far chains of drafts get accepted: R_d, the share of steps whose first d drafts were all accepted.

Decodes each prompt with chains of `max_length` drafts (one candidate per depth, as an engine such as
vLLM drafts) and counts, over every step of every prompt, how many of the chain's drafts were
accepted. A shorter chain is a prefix of a longer one (its drafts and, greedy, their acceptance are
the same), so one decode gives R_1..R_max_length for every length. Near a sequence's end a chain is
cut to the tokens left, so R_d counts the steps that drafted d or more. Per-position counts are what
vLLM reports as `spec_decode_num_accepted_tokens_per_pos` (vLLM drafts the full K to the end).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moe_spec.core.drafting import TreeBudget
from moe_spec.core.engine import SpecDecoder
from moe_spec.core.sampling import GREEDY, SamplingConfig
from moe_spec.core.step_record import DecodeObserver, StepRecord
from moe_spec.core.target import TargetModel
from moe_spec.policy.static import StaticController


@dataclass(frozen=True)
class ChainCounts:
    steps: int  # steps that drafted a chain
    accepted_per_position: tuple[int, ...]  # [K]: steps whose first d drafts were all accepted, d = 1..K
    drafted_per_position: tuple[int, ...]  # [K]: steps that drafted at least d (fewer near a sequence's end)
    per_prompt: tuple[tuple[tuple[int, int], ...], ...]  # per prompt, (drafted, accepted) of each step

    @property
    def reach(self) -> tuple[float, ...]:
        """R_1..R_K, each over the steps that drafted that far."""
        return tuple(a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position))

    @property
    def mean_accepted(self) -> float:
        """Drafts accepted per step."""
        return sum(self.accepted_per_position) / max(self.steps, 1)


class _Counter(DecodeObserver):
    def __init__(self):
        self.prompts: list[list[tuple[int, int]]] = []

    def on_step(self, record: StepRecord) -> None:
        for tree, acceptance in zip(record.verified.trees, record.acceptances):
            if tree.num_drafted:  # nothing drafted (the sequence's end): not a chain step
                self.prompts[-1].append((tree.num_drafted, acceptance.num_accepted))


def chain_counts(target: TargetModel, drafter, prompts: Sequence[torch.Tensor], max_length: int,
                 max_new_tokens: int = 48, sampling: SamplingConfig = GREEDY, seed: int = 0,
                 progress=None) -> ChainCounts:
    """Decode each prompt [T] with chains of `max_length` drafts; the accepted drafts per chain position."""
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    counter = _Counter()
    decoder = SpecDecoder(target, drafter=drafter, controller=StaticController(TreeBudget(max_length, max_length, 1)),
                          observer=counter)
    generator = torch.Generator().manual_seed(seed)
    for prompt in (progress(prompts) if progress is not None else prompts):
        counter.prompts.append([])
        decoder.generate(prompt[None], max_new_tokens=max_new_tokens, eos_token_id=[], generator=generator,
                         temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
    steps = [step for prompt in counter.prompts for step in prompt]
    return ChainCounts(
        len(steps),
        tuple(sum(1 for _, accepted in steps if accepted >= d) for d in range(1, max_length + 1)),
        tuple(sum(1 for drafted, _ in steps if drafted >= d) for d in range(1, max_length + 1)),
        tuple(tuple(prompt) for prompt in counter.prompts))
