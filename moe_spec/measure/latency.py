"""Timing verify passes and draft steps the way a decode step sees them.

Protocol: `warmup` untimed runs, then `repeats` timed runs, reporting the minimum (the time
the pass needs when nothing else competes; robust to other jobs on a shared machine) or the
median; both are recorded. Repeats of different configurations are interleaved. After each run the KV
cache is cut back to the prefix; before it, when `evict_mb > 0`, a buffer larger than the
last-level cache is written so the weights are read from memory rather than cache, as in a real
decode step where the drafter and the rest of the step ran in between ("cold weights").
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from moe_spec.core.drafting import BatchDrafter, Drafter, TreeBudget, batch_drafter
from moe_spec.measure.forced_routing import ForcedRouting, feasible, forced_assignment
from moe_spec.core.sampling import SamplingConfig
from moe_spec.core.target import TargetModel, synchronize
from moe_spec.core.tree import DraftTree, ancestor_mask


@dataclass(frozen=True)
class TimingConfig:
    repeats: int = 5
    warmup: int = 1
    evict_mb: int = 512  # 0: leave caches warm
    # of the repeats. "min" by default: load from other jobs only ever adds time, and on a shared
    # 2-core machine medians of the same pass varied 17-65 ms while minima held within a few %.
    statistic: str = "min"

    def __post_init__(self):
        if self.repeats < 1 or self.warmup < 0 or self.evict_mb < 0 or self.statistic not in ("median", "min"):
            raise ValueError(f"invalid timing config {self}")


class CacheEvictor:
    """Writes a large buffer to push the model's weights out of the caches of `device` (the CPU's
    caches, or a GPU's L2 when the model runs there), and waits for the write before a timing starts."""

    def __init__(self, megabytes: int, device: torch.device | str = "cpu"):
        self._device = torch.device(device)
        self._buffer = torch.zeros(megabytes * 2**20, dtype=torch.uint8, device=self._device) if megabytes > 0 else None

    def __call__(self) -> None:
        if self._buffer is not None:
            self._buffer.add_(1)
            synchronize(self._device)


@dataclass(frozen=True)
class Timing:
    times_ms: tuple[float, ...]  # every timed repeat
    unique_experts: tuple[int, ...]  # U per MoE layer in the timed pass

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times_ms)

    @property
    def min_ms(self) -> float:
        return min(self.times_ms)

    def ms(self, statistic: str) -> float:
        return self.median_ms if statistic == "median" else self.min_ms


def time_round_robin(
    runs: Sequence[Callable[[], tuple[int, ...]]],
    config: TimingConfig,
    evict: CacheEvictor,
    progress: Callable[[], None] = lambda: None,
) -> list[Timing]:
    """Time each run (a verify pass returning its unique experts per layer) `repeats` times.

    Repeats are interleaved (every run once, then every run again, ...) so that a burst of load
    from other processes spreads over all configurations instead of biasing one."""
    unique: list[tuple[int, ...]] = [()] * len(runs)
    for _ in range(config.warmup):
        for run in runs:
            evict()
            run()
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(config.repeats):
        for index, run in enumerate(runs):
            evict()
            start = time.perf_counter()
            unique[index] = run()
            times[index].append((time.perf_counter() - start) * 1000)
        progress()
    return [Timing(tuple(t), u) for t, u in zip(times, unique)]


def timed_median(run: Callable[[], None], config: TimingConfig, evict: CacheEvictor) -> tuple[float, list[float]]:
    """Median and all timed durations (ms) of one `run` under the protocol above."""
    [timing] = time_round_robin([lambda: (run(), ())[1]], config, evict)
    return timing.median_ms, list(timing.times_ms)


def prefill_cache(target: TargetModel, prefix: torch.Tensor):
    """A cache holding `prefix` ([P] long)."""
    cache = target.new_cache()
    n = prefix.numel()
    target.forward_tree(cache, prefix[None], torch.tril(torch.ones(n, n, dtype=torch.bool))[None], torch.arange(n)[None])
    return cache


def verify_run(
    target: TargetModel,
    cache,
    tree: DraftTree,
    forced: torch.Tensor | None = None,  # [L, N, K] routing to force, or None for natural routing
) -> Callable[[], tuple[int, ...]]:
    """One verify pass of `tree` on top of `cache`, cut back to the prefix afterwards; returns U per layer."""
    prefix_len = cache.get_seq_length()
    mask, position_ids = ancestor_mask(tree)[None], (prefix_len + tree.depths)[None]
    if forced is not None:
        forced = forced.to(target.device)  # once, outside the timed run (the routers' hooks then copy nothing)

    def run() -> tuple[int, ...]:
        if forced is None:
            out = target.forward_tree(cache, tree.tokens[None], mask, position_ids)
        else:
            with ForcedRouting(target.model, forced):
                out = target.forward_tree(cache, tree.tokens[None], mask, position_ids)
        target.synchronize()
        cache.crop(prefix_len - cache.get_seq_length())
        return tuple(out.routing.unique_per_layer())

    return run


def batched_prefill_cache(target: TargetModel, prefix: torch.Tensor, rows: int):
    """A cache holding `prefix` ([P] long) in each of `rows` batch rows."""
    cache = target.new_cache()
    n = prefix.numel()
    mask = torch.tril(torch.ones(n, n, dtype=torch.bool))[None].expand(rows, n, n)
    target.forward_tree(cache, prefix[None].expand(rows, n), mask, torch.arange(n)[None].expand(rows, n))
    return cache


def batched_verify_run(target: TargetModel, cache, trees: Sequence[DraftTree]) -> Callable[[], tuple[int, ...]]:
    """One batched verify pass (row b verifies `trees[b]`, padded as the engine pads) on a cache with one
    row per tree, cut back afterwards; returns U per layer: the union over all rows' tokens."""
    from moe_spec.core.batch_layout import step_inputs

    prefix_len = cache.get_seq_length()
    lengths = torch.full((len(trees),), prefix_len, dtype=torch.long)
    ids, mask, positions = step_inputs(list(trees), lengths)

    def run() -> tuple[int, ...]:
        out = target.forward_tree(cache, ids, mask, positions)
        target.synchronize()
        cache.crop(prefix_len - cache.get_seq_length())
        return tuple(out.routing.unique_per_layer())

    return run


def random_tree(num_nodes: int, vocab_size: int, generator: torch.Generator) -> DraftTree:
    """A tree of `num_nodes` nodes (root included) with random parents and random token ids."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=generator)) for i in range(1, num_nodes)]
    tokens = torch.randint(0, vocab_size, (num_nodes,), generator=generator).tolist()
    return DraftTree.from_lists(tokens, parents)


def grid_configs(target: TargetModel, tokens_grid: Sequence[int], experts_grid: Sequence[int]) -> list[tuple[int, int]]:
    """(T, U) pairs to time: infeasible ones (U < K or U > min(E, T*K)) skipped; U = 0 for a dense target."""
    if not target.is_moe:
        return [(t, 0) for t in tokens_grid]
    return [(t, u) for t in tokens_grid for u in experts_grid if feasible(t, u, target.num_experts, target.top_k)]


def grid_runs(
    target: TargetModel,
    cache,
    configs: Sequence[tuple[int, int]],
    generator: torch.Generator,
) -> list[Callable[[], tuple[int, ...]]]:
    """One verify run per (T, U): a random tree of T tokens, routing forced to U experts in every layer."""
    trees: dict[int, DraftTree] = {}
    runs = []
    for num_tokens, unique in configs:
        tree = trees.setdefault(num_tokens, random_tree(num_tokens, target.vocab_size, generator))
        forced = None
        if target.is_moe:
            forced = torch.stack(
                [forced_assignment(num_tokens, unique, target.num_experts, target.top_k, generator) for _ in target.routers]
            )
        runs.append(verify_run(target, cache, tree, forced))
    return runs


@dataclass(frozen=True)
class DraftCost:
    """Draft time in ms: base_ms + per_depth_ms * depth + per_node_ms * nodes (least squares)."""

    base_ms: float
    per_depth_ms: float
    per_node_ms: float
    samples: tuple[tuple[int, int, float], ...]  # (depth, drafted nodes, median ms)

    def predict_ms(self, depth: int, nodes: int) -> float:
        return self.base_ms + self.per_depth_ms * depth + self.per_node_ms * nodes

    def to_dict(self) -> dict:
        return {
            "formula": "ms = base_ms + per_depth_ms * depth + per_node_ms * drafted_nodes",
            "base_ms": self.base_ms,
            "per_depth_ms": self.per_depth_ms,
            "per_node_ms": self.per_node_ms,
            "samples": [list(s) for s in self.samples],
        }


def draft_cost(
    drafter: Drafter | BatchDrafter,
    root: int,
    budgets: Sequence[TreeBudget],
    config: TimingConfig,
) -> DraftCost:
    """Time `propose` of one row over budgets (the drafter must have `begin` run on one prompt);
    weights stay warm, since the draft head runs right after the previous step's commit touched it."""
    warm = CacheEvictor(0)
    greedy = SamplingConfig(0.0, 0, 1.0)
    row = batch_drafter(drafter, 1)  # the drafter itself, or a view of it as a batch of one
    samples = []
    for budget in budgets:
        trees: list[DraftTree] = []
        ms, _ = timed_median(lambda: trees.append(row.propose([root], budget, [budget.max_depth], greedy)[0]),
                             config, warm)
        tree = trees[-1]
        samples.append((int(tree.depths.max()), tree.num_drafted, ms))
    design = np.array([[1.0, d, n] for d, n, _ in samples])
    times = np.array([ms for *_, ms in samples])
    coef, *_ = np.linalg.lstsq(design, times, rcond=None)
    return DraftCost(float(coef[0]), float(coef[1]), float(coef[2]), tuple(samples))
