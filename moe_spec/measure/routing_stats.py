"""Which experts tokens activate: load, per-token-id distributions, co-activation, unique counts.

All counts are over *token routings*: one token in one MoE layer picks K experts, so a layer's
load row sums to K times the number of tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from moe_spec.core.step_record import StepRecord
from moe_spec.core.tree import DraftTree
from moe_spec.profile.expert_table import TokenExpertTable
from moe_spec.profile.unique_curve import UniqueExpertsCurve


class RoutingStats:
    """Accumulates routing of (token id, experts) pairs.

    load: [L, E] int64, tokens routed to each expert; coactivation: [L, E, E] int64, tokens
    routed to both e and f (diagonal: the load); token_counts: [V, L, E] int32, how often token
    id v was routed to e in layer l; token_totals: [V] int64, how often v was seen.
    """

    def __init__(self, vocab_size: int, num_layers: int, num_experts: int, top_k: int):
        self.vocab_size, self.num_layers, self.num_experts, self.top_k = vocab_size, num_layers, num_experts, top_k
        self.load = np.zeros((num_layers, num_experts), dtype=np.int64)
        self.coactivation = np.zeros((num_layers, num_experts, num_experts), dtype=np.int64)
        self.token_counts = np.zeros((vocab_size, num_layers, num_experts), dtype=np.int32)
        self.token_totals = np.zeros(vocab_size, dtype=np.int64)

    def add(self, tokens: torch.Tensor, experts: torch.Tensor) -> None:
        """tokens: [T] long; experts: [L, T, K] long, the routing of those tokens."""
        if experts.numel() == 0:
            return
        tok = tokens.cpu().numpy().astype(np.int64)
        ex = experts.cpu().numpy().astype(np.int64)  # [L, T, K]
        num_layers, num_tokens, top_k = ex.shape
        if num_tokens != tok.shape[0] or num_layers != self.num_layers:
            raise ValueError(f"routing {ex.shape} does not match {tok.shape[0]} tokens and {self.num_layers} layers")
        layer = np.arange(num_layers)[:, None, None]
        np.add.at(self.load, (np.broadcast_to(layer, ex.shape), ex), 1)
        np.add.at(self.token_counts, (tok[None, :, None], np.broadcast_to(layer, ex.shape), ex), 1)
        np.add.at(self.token_totals, tok, 1)
        first = ex[:, :, :, None]  # [L, T, K, 1]
        second = ex[:, :, None, :]  # [L, T, 1, K]
        pair_shape = (num_layers, num_tokens, top_k, top_k)
        np.add.at(
            self.coactivation,
            (np.broadcast_to(layer[..., None], pair_shape), np.broadcast_to(first, pair_shape), np.broadcast_to(second, pair_shape)),
            1,
        )

    @property
    def num_tokens(self) -> int:
        return int(self.token_totals.sum())

    def load_share(self) -> np.ndarray:
        """[L, E] share of each layer's token routings that went to each expert (rows sum to 1)."""
        total = self.load.sum(axis=1, keepdims=True)
        return self.load / np.maximum(total, 1)

    def imbalance(self) -> np.ndarray:
        """[L] busiest expert's load over the mean load."""
        mean = self.load.mean(axis=1)
        return self.load.max(axis=1) / np.maximum(mean, 1e-12)

    def idle_experts(self) -> np.ndarray:
        """[L] experts that no token was routed to."""
        return (self.load == 0).sum(axis=1)

    def token_concentration(self, min_count: int = 5) -> np.ndarray:
        """[L] for token ids seen >= min_count times, the mean share of their routings that went to
        their own K most frequent experts (1.0: a token id always picks the same experts)."""
        seen = self.token_totals >= min_count
        if not seen.any():
            return np.full(self.num_layers, np.nan)
        counts = self.token_counts[seen].astype(np.float64)  # [S, L, E]
        top = np.sort(counts, axis=-1)[..., -self.top_k:].sum(-1)  # [S, L]
        return (top / (self.token_totals[seen, None] * self.top_k)).mean(axis=0)

    def expert_table(self, pseudo_count: float = 1.0) -> TokenExpertTable:
        """The token-id expert predictor these counts make (see `TokenExpertTable`)."""
        return TokenExpertTable.from_counts(self.token_totals, self.token_counts, self.load, self.top_k, pseudo_count)


def best_first_order(tree: DraftTree) -> list[int]:
    """Node indices by decreasing cumulative draft score (ties: lower index), root first.

    A child's cumulative score never exceeds its parent's, so every prefix of this order is a
    connected subtree: the nodes a score-truncating controller would verify.
    """
    order = sorted(range(1, len(tree)), key=lambda i: (-float(tree.scores[i]), i))
    return [0] + order


def unique_experts_curve(
    steps: Sequence[StepRecord],
    pool: torch.Tensor,  # [L, P, K]: routing of decoded context tokens, the random baseline's population
    sizes: Sequence[int],
    generator: torch.Generator,
    random_draws: int = 64,
) -> UniqueExpertsCurve:
    """Unique experts for the best-first T nodes of real verified trees (one-row records) vs T random tokens."""
    num_layers = pool.shape[0]
    real = np.full((len(sizes), num_layers), np.nan)
    counts = []
    for row, size in enumerate(sizes):
        per_tree = []
        for step in steps:
            tree = step.tree()
            if len(tree) >= size:
                nodes = best_first_order(tree)[:size]
                per_tree.append(unique_per_layer(step.experts()[:, nodes]))
        counts.append(len(per_tree))
        if per_tree:
            real[row] = np.mean(per_tree, axis=0)
    random = np.zeros((len(sizes), num_layers))
    population = pool.shape[1]
    for row, size in enumerate(sizes):
        draws = [
            unique_per_layer(pool[:, torch.randperm(population, generator=generator)[: min(size, population)]])
            for _ in range(random_draws)
        ]
        random[row] = np.mean(draws, axis=0)
    return UniqueExpertsCurve(tuple(sizes), real, tuple(counts), random)


def unique_per_layer(experts: torch.Tensor) -> np.ndarray:
    """[L] distinct experts per layer; experts: [L, T, K]."""
    return np.array([torch.unique(layer).numel() for layer in experts], dtype=np.float64)
