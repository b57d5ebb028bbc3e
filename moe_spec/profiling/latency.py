"""Timing verify passes and draft steps the way a decode step sees them.

Protocol: `warmup` untimed runs, then `repeats` timed runs, reporting the median. Before each
run the KV cache is cut back to the prefix, and, when `evict_mb > 0`, a buffer larger than the
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

from moe_spec.cost_model import CostSample
from moe_spec.drafters.base import Drafter, TreeBudget
from moe_spec.profiling.forced_routing import ForcedRouting, feasible, forced_assignment
from moe_spec.sampling import SamplingConfig
from moe_spec.target import TargetModel
from moe_spec.tree import DraftTree, ancestor_mask


@dataclass(frozen=True)
class TimingConfig:
    repeats: int = 5
    warmup: int = 1
    evict_mb: int = 512  # 0: leave caches warm

    def __post_init__(self):
        if self.repeats < 1 or self.warmup < 0 or self.evict_mb < 0:
            raise ValueError(f"invalid timing config {self}")


class CacheEvictor:
    """Writes a large buffer to push the model's weights out of the CPU caches."""

    def __init__(self, megabytes: int):
        self._buffer = torch.zeros(megabytes * 2**20, dtype=torch.uint8) if megabytes > 0 else None

    def __call__(self) -> None:
        if self._buffer is not None:
            self._buffer.add_(1)


def timed_median(run: Callable[[], None], config: TimingConfig, evict: CacheEvictor) -> tuple[float, list[float]]:
    """Median and all timed durations (ms) of `run` under the protocol above."""
    for _ in range(config.warmup):
        evict()
        run()
    times = []
    for _ in range(config.repeats):
        evict()
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times), times


def prefill_cache(target: TargetModel, prefix: torch.Tensor):
    """A cache holding `prefix` ([P] long)."""
    cache = target.new_cache()
    n = prefix.numel()
    target.forward_tree(cache, prefix[None], torch.tril(torch.ones(n, n, dtype=torch.bool))[None], torch.arange(n)[None])
    return cache


def time_tree(
    target: TargetModel,
    cache,
    tree: DraftTree,
    config: TimingConfig,
    evict: CacheEvictor,
    forced: torch.Tensor | None = None,  # [L, N, K] routing to force, or None for natural routing
) -> tuple[float, tuple[int, ...]]:
    """Median verify time (ms) of `tree` on top of `cache`, and its unique experts per layer."""
    prefix_len = cache.get_seq_length()
    mask, position_ids = ancestor_mask(tree)[None], (prefix_len + tree.depths)[None]
    unique: list[tuple[int, ...]] = []

    def run() -> None:
        if forced is None:
            out = target.forward_tree(cache, tree.tokens[None], mask, position_ids)
        else:
            with ForcedRouting(target.model, forced):
                out = target.forward_tree(cache, tree.tokens[None], mask, position_ids)
        cache.crop(prefix_len - cache.get_seq_length())
        unique.append(tuple(out.routing.unique_per_layer()))

    median, _ = timed_median(run, config, evict)
    return median, unique[-1]


def random_tree(num_nodes: int, vocab_size: int, generator: torch.Generator) -> DraftTree:
    """A tree of `num_nodes` nodes (root included) with random parents and random token ids."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=generator)) for i in range(1, num_nodes)]
    tokens = torch.randint(0, vocab_size, (num_nodes,), generator=generator).tolist()
    return DraftTree.from_lists(tokens, parents)


@dataclass(frozen=True)
class GridPoint:
    num_tokens: int  # T
    unique_per_layer: int  # U forced in every MoE layer
    ms: float

    def sample(self, num_layers: int) -> CostSample:
        return CostSample(self.num_tokens, (self.unique_per_layer,) * num_layers, self.ms)


def latency_grid(
    target: TargetModel,
    cache,
    tokens_grid: Sequence[int],
    experts_grid: Sequence[int],
    config: TimingConfig,
    evict: CacheEvictor,
    generator: torch.Generator,
    progress: Callable[[], None] = lambda: None,
) -> list[GridPoint]:
    """Verify time over (T, U): T random-tree tokens, routing forced to U experts per layer.
    Infeasible pairs (U < K or U > min(E, T*K)) are skipped; dense targets time T only."""
    points = []
    num_layers, num_experts, top_k = len(target.routers), target.num_experts, target.top_k
    for num_tokens in tokens_grid:
        tree = random_tree(num_tokens, target.vocab_size, generator)
        if not target.is_moe:
            ms, _ = time_tree(target, cache, tree, config, evict)
            points.append(GridPoint(num_tokens, 0, ms))
            progress()
            continue
        for unique in experts_grid:
            if not feasible(num_tokens, unique, num_experts, top_k):
                continue
            forced = torch.stack([forced_assignment(num_tokens, unique, num_experts, top_k, generator) for _ in range(num_layers)])
            ms, measured_unique = time_tree(target, cache, tree, config, evict, forced)
            if set(measured_unique) != {unique}:
                raise RuntimeError(f"forcing {unique} experts per layer gave {measured_unique}")
            points.append(GridPoint(num_tokens, unique, ms))
            progress()
    return points


def grid_size(target: TargetModel, tokens_grid: Sequence[int], experts_grid: Sequence[int]) -> int:
    if not target.is_moe:
        return len(tokens_grid)
    return sum(feasible(t, u, target.num_experts, target.top_k) for t in tokens_grid for u in experts_grid)


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
    drafter: Drafter,
    root: int,
    budgets: Sequence[TreeBudget],
    config: TimingConfig,
) -> DraftCost:
    """Time `propose` over budgets (the drafter must have `begin` run); weights stay warm, since
    the draft head runs right after the previous step's commit touched it."""
    warm = CacheEvictor(0)
    greedy = SamplingConfig(0.0, 0, 1.0)
    samples = []
    for budget in budgets:
        trees: list[DraftTree] = []
        ms, _ = timed_median(lambda: trees.append(drafter.propose(root, budget, greedy)), config, warm)
        tree = trees[-1]
        samples.append((int(tree.depths.max()), tree.num_drafted, ms))
    design = np.array([[1.0, d, n] for d, n, _ in samples])
    times = np.array([ms for *_, ms in samples])
    coef, *_ = np.linalg.lstsq(design, times, rcond=None)
    return DraftCost(float(coef[0]), float(coef[1]), float(coef[2]), tuple(samples))
