"""Chain lengths for every request of a batch at once, for an engine that verifies chains (vLLM).

Each request i can draft a chain; its d-th draft adds r_{i,d} expected tokens (the chance its first d
drafts are all accepted) and one token to the verify pass. The pass's cost depends on the batch's
total tokens n alone (`PassCost`: a fixed part, a part per token, and per MoE layer the experts that
n tokens route to, E (1 - (1 - q_l)^n) with q_l each token's share of new experts, read from the
target's own gates). So the best set of drafts of any size m is the m drafts of highest r (a chain's
r never grows with depth, so that set is made of chain prefixes), and the batch speculates the m of
most tokens per ms:

    m* = argmax_m (B + sum of the m best r) / (PassCost(B + m) + draft_ms(deepest chain))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PassCost:
    """ms of a verify pass of n tokens over `rows` rows (the profile's cost model, experts by share)."""

    base_ms: float
    per_row_ms: float
    per_token_ms: float
    per_expert_ms: np.ndarray  # [L]
    num_experts: int  # E, 0 for a dense target
    new_expert_share: np.ndarray  # [L] q_l: the share of a layer's experts one more token adds, on average

    def unique_experts(self, tokens: np.ndarray) -> np.ndarray:
        """[..., L] expected distinct experts per layer for each token count in `tokens` [...]."""
        if self.num_experts == 0:
            return np.zeros((*np.shape(tokens), len(self.per_expert_ms)))
        n = np.asarray(tokens, dtype=np.float64)[..., None]
        return self.num_experts * (1.0 - (1.0 - self.new_expert_share) ** n)

    def ms(self, tokens: np.ndarray, rows: int) -> np.ndarray:
        """[...] verify ms for each total token count in `tokens` [...]."""
        tokens = np.asarray(tokens, dtype=np.float64)
        experts = self.unique_experts(tokens) @ self.per_expert_ms
        return max(self.base_ms + self.per_row_ms * (rows - 1), 0.0) + self.per_token_ms * tokens + experts


def share_from_union(unique: np.ndarray, tokens: int, num_experts: int) -> np.ndarray:
    """[L] q_l such that `tokens` tokens routing independently cover `unique[l]` of E experts."""
    covered = np.clip(np.asarray(unique, dtype=np.float64) / num_experts, 0.0, 1.0 - 1e-9)
    return 1.0 - (1.0 - covered) ** (1.0 / max(tokens, 1))


def batch_chain_lengths(reach: Sequence[Sequence[float]], cost: PassCost,
                        draft_ms: Callable[[int], float] = lambda depth: 0.0) -> list[int]:
    """Per request, how many drafts of its chain to propose; reach[i][d - 1] = r_{i,d} (non-increasing in d)."""
    rows = len(reach)
    if rows == 0:
        return []
    candidates = sorted(((r, i, d) for i, chain in enumerate(reach) for d, r in enumerate(chain, 1) if r > 0.0),
                        key=lambda c: (-c[0], c[1], c[2]))
    if not candidates:
        return [0] * rows
    values = rows + np.cumsum([0.0] + [r for r, _, _ in candidates])  # tokens per step for m = 0..M
    deepest = np.maximum.accumulate([0] + [d for _, _, d in candidates])
    times = cost.ms(rows + np.arange(len(values)), rows) + np.array([draft_ms(int(d)) for d in deepest])
    best = int(np.argmax(values / np.maximum(times, 1e-9)))  # ties: the fewest drafts
    lengths = [0] * rows
    for _, i, d in candidates[:best]:
        lengths[i] = max(lengths[i], d)
    return lengths
