"""What reading missing experts from the slow tier costs one verify pass, per MoE layer.

    m_l(M) [ms]: the time layer l of a pass spends fetching the M experts it needs that are not
                 resident (parallel reads: m_l grows slower than linearly in M)

It is measured, not assumed (`moe_spec.measure.fetch_costs`): for each layer the profiler times
fetches of M random experts at a grid of M, and `FetchCost` interpolates linearly between the grid
points (m(0) = 0) and extends the last segment's slope beyond the grid. The cost model adds
sum_l m_l(M_l) to a pass (`CostModel.predict_ms(..., misses=...)`), and the controller prices a
node's predicted non-resident experts at the marginal cost `miss_price` (see `policy/selection.py`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class FetchCost:
    counts: tuple[int, ...]  # [G] misses per layer at which m was measured, increasing, all >= 1
    ms: tuple[tuple[float, ...], ...]  # [L][G] measured m_l at each count
    tier: str = "disk"
    bytes_per_expert: int = 0

    def __post_init__(self):
        if not self.counts or list(self.counts) != sorted(set(self.counts)) or self.counts[0] < 1:
            raise ValueError(f"fetch cost counts must be increasing and >= 1, got {self.counts}")
        if any(len(row) != len(self.counts) for row in self.ms):
            raise ValueError("every layer needs one fetch time per count")
        if not all(math.isfinite(v) and v >= 0 for row in self.ms for v in row):
            raise ValueError("fetch times must be finite and >= 0")

    @property
    def num_layers(self) -> int:
        return len(self.ms)

    def layer_ms(self, misses: np.ndarray | Sequence[float]) -> np.ndarray:
        """[L] m_l(M_l) for the (possibly fractional, expected) misses M [L] of each layer."""
        misses = np.asarray(misses, dtype=np.float64)
        if misses.shape != (self.num_layers,):
            raise ValueError(f"expected {self.num_layers} miss counts, got shape {misses.shape}")
        x = np.concatenate([[0.0], np.asarray(self.counts, dtype=np.float64)])  # [G + 1]
        out = np.empty(self.num_layers)
        for layer, row in enumerate(self.ms):
            y = np.concatenate([[0.0], np.asarray(row)])
            slope = (y[-1] - y[-2]) / (x[-1] - x[-2])
            m = misses[layer]
            out[layer] = np.interp(m, x, y) if m <= x[-1] else y[-1] + slope * (m - x[-1])
        return out

    def total_ms(self, misses) -> float:
        return float(self.layer_ms(misses).sum())

    def miss_price(self, misses, added: float = 1.0) -> np.ndarray:
        """[L] ms per further miss in each layer, once M_l misses are already being read: the mean slope
        of m_l over the next `added` misses (parallel reads make later misses cheaper)."""
        misses = np.asarray(misses, dtype=np.float64)
        return (self.layer_ms(misses + added) - self.layer_ms(misses)) / added

    def to_dict(self) -> dict:
        return {"formula": "ms = m_l(M_l), linear between measured counts", "counts": list(self.counts),
                "ms": [list(row) for row in self.ms], "tier": self.tier, "bytes_per_expert": self.bytes_per_expert}

    @staticmethod
    def from_dict(data: dict) -> "FetchCost":
        return FetchCost(tuple(int(c) for c in data["counts"]), tuple(tuple(float(v) for v in row) for row in data["ms"]),
                         str(data.get("tier", "disk")), int(data.get("bytes_per_expert", 0)))
