"""A long run in one process: does decoding leak memory or hooks, or slow down, over many generations?

The soak decodes N generations of mixed prompt lengths, new-token counts, batch sizes, methods
and temperatures through one `SpecDecoder` per method (as a server would keep them), and reads,
after a warm-up and again at the end:
- resident memory (RSS, from /proc) after a garbage collection;
- hooks registered on every module of the target and the draft head (a context-managed
  recorder that failed to remove its hooks would show up here);
- tokens/s of the first `window` generations against the last `window`.

The schedule is one block of `window` random jobs, repeated: generation i runs job i % window,
with a sampling generator seeded by the job. Any `window` consecutive generations then run the
same work, so the first and last windows compare like with like, and every repeat of a greedy job
must reproduce its first output exactly (a state leak between calls would change it).

The long generation decodes one row from a short prompt up to the model's context (no EOS) and
samples RSS on the way, beside the bytes the KV cache holds per position (measured on a real
cache), so memory growth can be read against the cache's own growth.
"""

from __future__ import annotations

import gc
import os
import random
import resource
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm

from moe_spec.core.batch_layout import prefill_inputs
from moe_spec.core.engine import SpecDecoder
from moe_spec.core.step_record import DecodeObserver, StepRecord
from moe_spec.core.target import TargetModel
from moe_spec.errors import InputError
from moe_spec.core.inputs import left_pad
from moe_spec.policy.registry import Method


@dataclass(frozen=True)
class SoakSettings:
    generations: int = 1000
    new_tokens: tuple[int, int] = (4, 24)  # inclusive range of max_new_tokens per generation
    prompt_tokens: tuple[int, int] = (4, 160)  # inclusive range each prompt is cut to
    batch_sizes: tuple[int, ...] = (1, 2, 4)
    temperatures: tuple[float, ...] = (0.0, 0.7, 1.0)
    window: int = 100  # generations per schedule block; the first and last windows are compared
    seed: int = 0

    def __post_init__(self):
        if self.generations < 1 or self.window < 1 or self.window > self.generations:
            raise InputError(f"need 1 <= window ({self.window}) <= generations ({self.generations})")
        for name, (low, high) in (("new_tokens", self.new_tokens), ("prompt_tokens", self.prompt_tokens)):
            if not 1 <= low <= high:
                raise InputError(f"{name} range must satisfy 1 <= low <= high, got {low}..{high}")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise InputError(f"batch sizes must be >= 1, got {self.batch_sizes}")
        if not self.temperatures or min(self.temperatures) < 0:
            raise InputError(f"temperatures must be >= 0, got {self.temperatures}")


@dataclass(frozen=True)
class Job:
    """One generation of the schedule."""

    method: str
    prompts: tuple[int, ...]  # indices into the prompt pool, one per row
    prompt_tokens: tuple[int, ...]  # each row's prompt cut to its first this many tokens
    new_tokens: int
    temperature: float
    seed: int  # of the job's sampling generator


def schedule(settings: SoakSettings, methods: Sequence[str], pool: int) -> list[Job]:
    """One block of `settings.window` jobs drawn from a seeded RNG (the soak repeats it)."""
    rng = random.Random(settings.seed)
    jobs = []
    for j in range(settings.window):
        batch = rng.choice(settings.batch_sizes)
        jobs.append(Job(
            method=methods[j % len(methods)],  # every method equally often in a block
            prompts=tuple(rng.randrange(pool) for _ in range(batch)),
            prompt_tokens=tuple(rng.randint(*settings.prompt_tokens) for _ in range(batch)),
            new_tokens=rng.randint(*settings.new_tokens),
            temperature=rng.choice(settings.temperatures),
            seed=settings.seed * 1_000_003 + j,
        ))
    return jobs


def rss_bytes() -> int:
    """Resident memory of this process now (Linux /proc; elsewhere the peak, from getrusage)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def registered_hooks(*modules: nn.Module | None) -> int:
    """Hooks of every kind registered on these modules and all their submodules, plus torch's global
    module hooks."""
    kinds = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    seen: set[int] = set()
    total = 0
    for root in modules:
        if root is None:
            continue
        for module in root.modules():
            if id(module) not in seen:
                seen.add(id(module))
                total += sum(len(getattr(module, kind, {})) for kind in kinds)
    glob = nn.modules.module
    return total + sum(len(getattr(glob, name, {})) for name in (
        "_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks", "_global_backward_pre_hooks"))


def cache_bytes_per_position(target: TargetModel, prompt: torch.Tensor) -> float:
    """Bytes a real KV cache of this target holds per cached position (one row), measured."""
    cache = target.new_cache()
    ids, mask, positions, _ = prefill_inputs([prompt], pad_token=0)
    target.forward_tree(cache, ids, mask, positions)
    total = sum(layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
                for layer in cache.layers if layer.is_initialized)
    return total / prompt.numel()


@dataclass
class Window:
    tokens: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


@dataclass
class SoakResult:
    generations: int
    new_tokens: int
    seconds: float
    rss_start_bytes: int  # after warm-up
    rss_end_bytes: int
    rss_peak_bytes: int
    rss_samples: list[tuple[int, int]]  # (generations done, RSS bytes), every window
    hooks_start: int
    hooks_end: int
    first_window: Window
    last_window: Window
    greedy_repeats_checked: int
    greedy_mismatches: int  # repeats of a greedy job whose output differed from its first run
    sampled_mismatches: int  # the same for sampled jobs (informational: online controllers adapt)
    per_method: dict[str, dict] = field(default_factory=dict)
    long: dict | None = None

    @property
    def rss_growth(self) -> float:
        return (self.rss_end_bytes - self.rss_start_bytes) / self.rss_start_bytes

    @property
    def tokens_per_s_drift(self) -> float:
        """Last window's tokens/s over the first's, minus one."""
        first = self.first_window.tokens_per_s
        return self.last_window.tokens_per_s / first - 1 if first else 0.0

    def to_json(self) -> dict:
        body = asdict(self)
        body.update(rss_growth=self.rss_growth, tokens_per_s_drift=self.tokens_per_s_drift,
                    first_window_tokens_per_s=self.first_window.tokens_per_s,
                    last_window_tokens_per_s=self.last_window.tokens_per_s)
        return body


class _MemoryTrace(DecodeObserver):
    """RSS every `every` positions of a one-row generation."""

    def __init__(self, every: int):
        self.every, self.samples, self._next = every, [], 0

    def on_step(self, record: StepRecord) -> None:
        position = record.prefix_lens[0]
        if position >= self._next:
            self.samples.append((position, rss_bytes()))
            self._next = position + self.every


def run_soak(
    target: TargetModel,
    methods: Sequence[Method],
    pool: Sequence[torch.Tensor],  # prompt pool, each [T] long
    settings: SoakSettings,
    extra_modules: Sequence[nn.Module] = (),  # e.g. the draft head, counted for hooks
    progress: bool | None = None,
) -> SoakResult:
    """Warm-up, then the soak's generations (`long_generation` is the separate second part)."""
    if not methods or not pool:
        raise InputError("a soak needs at least one method and one prompt")
    decoders = {m.name: SpecDecoder(target, drafter=m.drafter, controller=m.controller) for m in methods}
    block = schedule(settings, [m.name for m in methods], len(pool))
    pad = int(getattr(target.model.generation_config, "pad_token_id", None) or 0)

    def generate(job: Job):
        ids, mask = left_pad([pool[p][None, :n] for p, n in zip(job.prompts, job.prompt_tokens)], pad)
        start = time.perf_counter()
        result = decoders[job.method].generate(ids, attention_mask=mask, max_new_tokens=job.new_tokens,
                                               temperature=job.temperature,
                                               generator=torch.Generator().manual_seed(job.seed))
        return result, time.perf_counter() - start

    # 1) warm-up: every method at every batch size, longest prompts and outputs (not counted)
    longest = max(p.numel() for p in pool)
    for name in decoders:
        for batch in settings.batch_sizes:
            generate(Job(name, tuple(b % len(pool) for b in range(batch)), (min(longest, settings.prompt_tokens[1]),) * batch,
                         settings.new_tokens[1], max(settings.temperatures), settings.seed))
    gc.collect()
    rss_start, hooks_start = rss_bytes(), registered_hooks(target.model, *extra_modules)

    # 2) the soak
    first, last = Window(), Window()
    outputs: dict[int, list[int]] = {}
    checked = greedy_bad = sampled_bad = 0
    per_method: dict[str, Window] = {m.name: Window() for m in methods}
    samples = []
    total = Window()
    bar = tqdm(total=settings.generations, desc="soak", unit="gen", disable=None if progress is None else not progress)
    for i in range(settings.generations):
        job = block[i % settings.window]
        result, seconds = generate(job)
        tokens = result.stats.new_tokens
        for window in (total, per_method[job.method]) + ((first,) if i < settings.window else ()) + (
                (last,) if i >= settings.generations - settings.window else ()):
            window.tokens += tokens
            window.seconds += seconds
        output = result.sequences.flatten().tolist()
        previous = outputs.setdefault(i % settings.window, output)
        if i >= settings.window:
            checked += 1
            if previous != output:
                if job.temperature == 0:
                    greedy_bad += 1
                else:
                    sampled_bad += 1
        if (i + 1) % settings.window == 0:
            samples.append((i + 1, rss_bytes()))
        bar.set_postfix_str(f"{job.method} B={len(job.prompts)} t={job.temperature}", refresh=False)
        bar.update()
    bar.close()
    gc.collect()
    return SoakResult(
        generations=settings.generations, new_tokens=total.tokens, seconds=total.seconds,
        rss_start_bytes=rss_start, rss_end_bytes=rss_bytes(),
        rss_peak_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, rss_samples=samples,
        hooks_start=hooks_start, hooks_end=registered_hooks(target.model, *extra_modules),
        first_window=first, last_window=last, greedy_repeats_checked=checked, greedy_mismatches=greedy_bad,
        sampled_mismatches=sampled_bad,
        per_method={name: {"tokens": w.tokens, "seconds": w.seconds, "tokens_per_s": w.tokens_per_s}
                    for name, w in per_method.items() if w.seconds},
    )
    return result


def long_generation(target: TargetModel, method: Method, prompt: torch.Tensor, positions: int | None = None,
                    every: int = 128) -> dict:
    """Decode one row from `prompt` ([T] long) until `positions` (default: the model's context) with
    no EOS, sampling RSS every `every` positions."""
    positions = positions or target.max_positions
    if positions is None:
        raise InputError("the model declares no context length (max_position_embeddings); give positions")
    per_position = cache_bytes_per_position(target, prompt)
    trace = _MemoryTrace(every)
    decoder = SpecDecoder(target, drafter=method.drafter, controller=method.controller, observer=trace)
    gc.collect()
    before = rss_bytes()
    start = time.perf_counter()
    result = decoder.generate(prompt[None], max_new_tokens=positions - prompt.numel(), eos_token_id=[])
    seconds = time.perf_counter() - start
    peak_during = max([before] + [rss for _, rss in trace.samples])
    del result
    gc.collect()
    after = rss_bytes()
    return {
        "method": method.name,
        "prompt_tokens": int(prompt.numel()),
        "positions": positions,
        "seconds": seconds,
        "tokens_per_s": (positions - prompt.numel()) / seconds,
        "cache_bytes_per_position": per_position,
        "cache_bytes_at_context": per_position * positions,
        "rss_before_bytes": before,
        "rss_peak_during_bytes": peak_during,
        "rss_after_bytes": after,
        "rss_growth_during_bytes": peak_during - before,
        "rss_samples": trace.samples,
    }


def format_soak(result: SoakResult) -> str:
    """A human summary."""
    mib = 2 ** 20
    lines = [
        f"generations          {result.generations} ({result.new_tokens} new tokens in {result.seconds:.0f} s)",
        f"RSS after warm-up    {result.rss_start_bytes / mib:.1f} MiB",
        f"RSS at the end       {result.rss_end_bytes / mib:.1f} MiB ({result.rss_growth:+.2%})",
        f"RSS peak             {result.rss_peak_bytes / mib:.1f} MiB",
        f"hooks start / end    {result.hooks_start} / {result.hooks_end}",
        f"tokens/s             first window {result.first_window.tokens_per_s:.1f}, "
        f"last window {result.last_window.tokens_per_s:.1f} "
        f"({result.tokens_per_s_drift:+.1%})",
        f"repeats reproduced   greedy {result.greedy_mismatches} mismatches, sampled {result.sampled_mismatches} "
        f"(of {result.greedy_repeats_checked} repeats)",
    ]
    for name, figures in result.per_method.items():
        lines.append(f"  {name:<22} {figures['tokens_per_s']:7.1f} tokens/s")
    if result.long is not None:
        long = result.long
        lines += [
            f"long generation      {long['method']} to {long['positions']} positions in {long['seconds']:.0f} s "
            f"({long['tokens_per_s']:.1f} tokens/s)",
            f"  RSS before / peak / after  {long['rss_before_bytes'] / mib:.1f} / "
            f"{long['rss_peak_during_bytes'] / mib:.1f} / {long['rss_after_bytes'] / mib:.1f} MiB; "
            f"KV cache at context {long['cache_bytes_at_context'] / mib:.1f} MiB",
        ]
    return "\n".join(lines)

