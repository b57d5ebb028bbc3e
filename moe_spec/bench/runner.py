"""Running methods side by side: one process, the same prompts, interleaved.

For each prompt every method runs once, in an order rotated by one per prompt, so slow drift of
the machine (thermal state, other load) falls on all methods alike; a warm-up generate per method
comes first and is not counted. Sampling draws from a `torch.Generator` seeded per prompt, not per
method or position in the method list, so a method's output does not depend on what else runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from tqdm.auto import tqdm

from moe_spec.bench.methods import Method
from moe_spec.engine import SpecDecoder
from moe_spec.errors import InputError
from moe_spec.stats import GenerationStats
from moe_spec.target import TargetModel


@dataclass(frozen=True)
class RunSettings:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    seed: int = 0
    warmup_tokens: int = 16  # per method, on the first prompt; not counted

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise InputError(f"temperature must be >= 0, got {self.temperature}")
        if self.warmup_tokens < 0:
            raise InputError(f"warmup_tokens must be >= 0, got {self.warmup_tokens}")


@dataclass(frozen=True)
class Run:
    """One method on one prompt."""

    prompt_index: int
    method: str
    stats: GenerationStats
    new_ids: tuple[int, ...]


def method_order(methods: Sequence[Method], prompt_index: int) -> list[Method]:
    """The methods rotated left by `prompt_index`."""
    shift = prompt_index % len(methods)
    return list(methods[shift:]) + list(methods[:shift])


def prompt_generator(seed: int, prompt_index: int) -> torch.Generator:
    """The sampling generator of a prompt, the same for every method (common random numbers)."""
    return torch.Generator().manual_seed(seed * 1_000_003 + prompt_index)


def run_methods(
    target: TargetModel,
    methods: Sequence[Method],
    prompts: Sequence[torch.Tensor],  # each [1, T] long
    settings: RunSettings,
    progress: bool | None = None,  # None: a bar only on a terminal
) -> list[Run]:
    """Every method on every prompt, in run order."""
    if not methods or not prompts:
        raise InputError("nothing to run: give at least one method and one prompt")
    decoders = {m.name: SpecDecoder(target, drafter=m.drafter, controller=m.controller) for m in methods}

    def generate(method: Method, index: int, max_new_tokens: int):
        return decoders[method.name].generate(
            prompts[index],
            max_new_tokens=max_new_tokens,
            temperature=settings.temperature,
            generator=prompt_generator(settings.seed, index),
        )

    if settings.warmup_tokens:
        for method in methods:
            generate(method, 0, min(settings.warmup_tokens, settings.max_new_tokens))

    runs: list[Run] = []
    bar = tqdm(total=len(prompts) * len(methods), desc="bench", unit="run", disable=None if progress is None else not progress)
    for index, prompt in enumerate(prompts):
        for method in method_order(methods, index):
            bar.set_postfix_str(f"prompt {index} {method.name}", refresh=False)
            result = generate(method, index, settings.max_new_tokens)
            new_ids = tuple(result.sequences[0, prompt.shape[1]:].tolist())
            runs.append(Run(index, method.name, result.stats, new_ids))
            bar.update()
    bar.close()
    return runs
