"""Running methods side by side: one process, the same prompts, interleaved.

For each prompt (or batch of prompts) every method runs once, in an order rotated by one per
prompt, so slow drift of the machine (thermal state, other load) falls on all methods alike; a
warm-up generate per method comes first and is not counted. Sampling draws from a
`torch.Generator` seeded per prompt (per batch: by its first prompt), not per method or position
in the method list, so a method's output does not depend on what else runs.

With the target's experts offloaded (`target.offload`), every generation, warm-up included, starts
from an empty resident cache: see `run_methods`. Its reads are in the run's `GenerationStats`
(`misses_per_token`, `bytes_read_per_token`, `hit_rate`: decode steps, the prefill's not counted).

With `batch_size` B > 1, prompts of the same class are decoded B at a time (left-padded), so
per-class figures stay meaningful; a run's stats then cover its whole batch.

A method is one of moe_spec's (a registry `Method`: `SpecDecoder` with its drafter and controller)
or one of transformers' own loops (an `HFReference`, see `hf_reference.py`); both decode through
the same `generate(ids, attention_mask=..., ...)` call and are timed and interleaved alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from tqdm.auto import tqdm

from moe_spec.policy.registry import Method
from moe_spec.core.engine import SpecDecoder
from moe_spec.core.inputs import left_pad
from moe_spec.experiments.hf_reference import HFReference
from moe_spec.core.sampling import SamplingConfig
from moe_spec.errors import InputError
from moe_spec.core.stats import GenerationStats
from moe_spec.core.target import TargetModel


@dataclass(frozen=True)
class RunSettings:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    seed: int = 0
    warmup_tokens: int = 16  # per method, on the first prompt; not counted
    batch_size: int = 1
    repeats: int = 1  # every method on every prompt this many times, interleaved; figures are totals
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        SamplingConfig(self.temperature, self.top_k, self.top_p)  # raises InputError naming a bad setting
        if self.batch_size < 1:
            raise InputError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.warmup_tokens < 0:
            raise InputError(f"warmup_tokens must be >= 0, got {self.warmup_tokens}")
        if self.repeats < 1:
            raise InputError(f"repeats must be >= 1, got {self.repeats}")


@dataclass(frozen=True)
class Run:
    """One method on one prompt, or on one batch of prompts."""

    prompt_indices: tuple[int, ...]
    method: str
    stats: GenerationStats  # of the whole batch
    new_ids: tuple[tuple[int, ...], ...]  # per prompt of the batch
    repeat: int = 0  # which pass over the prompts
    greedy: bool = True  # decoded at temperature 0: every lossless method's output is then the same

    @property
    def prompt_index(self) -> int:
        """The batch's first prompt (every prompt of a batch has the same class)."""
        return self.prompt_indices[0]

    def new_ids_of(self, prompt_index: int) -> tuple[int, ...]:
        return self.new_ids[self.prompt_indices.index(prompt_index)]


def batches(classes: Sequence[str], batch_size: int) -> list[list[int]]:
    """Prompt indices grouped by class (in first-seen order) into chunks of `batch_size`."""
    groups: dict[str, list[int]] = {}
    for index, name in enumerate(classes):
        groups.setdefault(name, []).append(index)
    return [group[i : i + batch_size] for group in groups.values() for i in range(0, len(group), batch_size)]


def method_order(methods: Sequence[Method], prompt_index: int) -> list[Method]:
    """The methods rotated left by `prompt_index`."""
    shift = prompt_index % len(methods)
    return list(methods[shift:]) + list(methods[:shift])


def prompt_generator(seed: int, prompt_index: int, repeat: int = 0) -> torch.Generator:
    """The sampling generator of a prompt in a pass, the same for every method (common random
    numbers). Each repeated pass draws afresh: under sampling every method writes its own text, and
    its acceptance moves with that text as much as its time moves with the machine, so a second pass
    over the same draws would average only the timing noise."""
    return torch.Generator().manual_seed(seed * 1_000_003 + prompt_index + repeat * 7_919_000_011)


def run_methods(
    target: TargetModel,
    methods: Sequence[Method | HFReference],
    prompts: Sequence[torch.Tensor],  # each [1, T] long
    settings: RunSettings,
    progress: bool | None = None,  # None: a bar only on a terminal
    classes: Sequence[str] | None = None,  # per prompt; batches never mix classes
) -> list[Run]:
    """Every method on every prompt (or batch), in run order."""
    if not methods or not prompts:
        raise InputError("nothing to run: give at least one method and one prompt")
    decoders = {m.name: _decoder(target, m) for m in methods}
    groups = batches(classes or ["all"] * len(prompts), settings.batch_size)
    pad = int(getattr(target.model.generation_config, "pad_token_id", None) or 0)

    def generate(method: Method | HFReference, group: list[int], max_new_tokens: int, repeat: int = 0):
        ids, mask = left_pad([prompts[i] for i in group], pad)
        offload = getattr(target, "offload", None)  # a stand-in target may not carry one
        if offload is not None:
            # a cold cache for every generation: otherwise a method would inherit the experts the one
            # before it (in the rotated order) left resident, and its misses, bytes read and time would
            # depend on its neighbour rather than on its own drafting
            offload.clear()
        return ids, decoders[method.name].generate(
            ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            temperature=settings.temperature,
            top_k=settings.top_k,
            top_p=settings.top_p,
            generator=prompt_generator(settings.seed, group[0], repeat),
        )

    if settings.warmup_tokens:
        for method in methods:
            generate(method, groups[0], min(settings.warmup_tokens, settings.max_new_tokens))

    runs: list[Run] = []
    bar = tqdm(total=settings.repeats * len(groups) * len(methods), desc="bench", unit="run",
               disable=None if progress is None else not progress)
    for repeat in range(settings.repeats):
        for order, group in enumerate(groups):
            for method in method_order(methods, order + repeat):
                bar.set_postfix_str(f"pass {repeat + 1}, prompts {group[0]}.. {method.name}", refresh=False)
                ids, result = generate(method, group, settings.max_new_tokens, repeat)
                new_ids = tuple(_until_padding(result.sequences[row, ids.shape[1]:].tolist(), result, row)
                                for row in range(len(group)))
                runs.append(Run(tuple(group), method.name, result.stats, new_ids, repeat, settings.temperature == 0))
                bar.update()
    bar.close()
    return runs


def _decoder(target: TargetModel, method: Method | HFReference):
    """What decodes `method`: transformers' own loop for a reference, else `SpecDecoder`."""
    if isinstance(method, HFReference):
        return method.decoder(target)
    return SpecDecoder(target, drafter=method.drafter, controller=method.controller)


def _until_padding(tokens: list[int], result, row: int) -> tuple[int, ...]:
    """A row's own new tokens: batched outputs are right-padded to the longest row."""
    produced = result.stats.new_tokens_per_row[row] if result.stats.new_tokens_per_row else len(tokens)
    return tuple(tokens[:produced])
