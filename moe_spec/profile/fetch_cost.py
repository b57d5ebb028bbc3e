"""What reading missing experts from the slow tier costs one verify pass, per MoE layer.

    m_l(M) [ms]: the time layer l of a pass spends fetching the M experts it needs that are not
                 resident (parallel reads: m_l grows slower than linearly in M)
    s:           what a pass's reads add to it per ms of m_l (below 1 where reads overlap compute)
    o [ms]:      what each expert a pass needs beyond the C resident slots of a layer adds (U_l > C):
                 the offload streams those through a few scratch slots, a chunk at a time, each
                 chunk's read waited for and its rows computed apart (`ExpertOffload._stream_overflow`),
                 so they cost more than m_l's one parallel read and one grouped call

It is measured, not assumed (`moe_spec.measure.fetch_costs`): for each layer the profiler times
fetches of M random experts at a grid of M, and `FetchCost` interpolates linearly between the grid
points (m(0) = 0) and extends the last segment's slope beyond the grid; s and o are fitted on the
fetch stage's decoded passes (`moe_spec.measure.fetch_profile`). The cost model adds
sum_l s m_l(M_l) + o max(U_l - C, 0) to a pass (`CostModel.predict_ms(..., misses=...)`), C the
`capacity` of the run's cache, and the controller prices a node's predicted non-resident experts at
the marginal cost `miss_price`, plus o once a layer's expected experts fill its slots (see
`policy/selection.py`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np


@dataclass(frozen=True)
class FetchCost:
    counts: tuple[int, ...]  # [G] misses per layer at which m was measured, increasing, all >= 1
    ms: tuple[tuple[float, ...], ...]  # [L][G] measured m_l at each count
    tier: str = "disk"
    bytes_per_expert: int = 0
    overflow_ms: float = 0.0  # o: ms per expert a pass needs beyond a layer's resident slots
    capacity: int | None = None  # C: resident slots per layer of the cache priced (None: overflow not priced)
    # what a pass's reads add to it per ms of the same reads timed alone (m_l): below 1 where reads
    # overlap compute and hide, above where reading takes more from the cores than its wait (fitted
    # by the fetch stage on passes read as the run reads them: on demand, or a layer ahead)
    scale: float = 1.0

    def __post_init__(self):
        if not self.counts or list(self.counts) != sorted(set(self.counts)) or self.counts[0] < 1:
            raise ValueError(f"fetch cost counts must be increasing and >= 1, got {self.counts}")
        if any(len(row) != len(self.counts) for row in self.ms):
            raise ValueError("every layer needs one fetch time per count")
        if not all(math.isfinite(v) and v >= 0 for row in self.ms for v in row):
            raise ValueError("fetch times must be finite and >= 0")
        if not (math.isfinite(self.overflow_ms) and self.overflow_ms >= 0):
            raise ValueError(f"the overflow cost must be finite and >= 0 ms, got {self.overflow_ms}")
        if not (math.isfinite(self.scale) and self.scale >= 0):
            raise ValueError(f"the fetch scale must be finite and >= 0, got {self.scale}")
        if self.capacity is not None and self.capacity < 0:
            raise ValueError(f"the resident capacity must be >= 0 experts per layer, got {self.capacity}")

    @property
    def num_layers(self) -> int:
        return len(self.ms)

    def layer_ms(self, misses: np.ndarray | Sequence[float]) -> np.ndarray:
        """[L] scale * m_l(M_l) for the (possibly fractional, expected) misses M [L] of each layer."""
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
        return out * self.scale

    def overflow(self, unique) -> np.ndarray:
        """[L] experts beyond each layer's resident slots for a pass loading `unique` [L] distinct
        experts per layer (expected counts allowed); zeros where no capacity is priced."""
        unique = np.asarray(unique, dtype=np.float64)
        if self.capacity is None:
            return np.zeros_like(unique)
        return np.maximum(unique - self.capacity, 0.0)

    def total_ms(self, misses, unique=None) -> float:
        """sum_l scale * m_l(M_l), plus o per expert beyond the resident slots where `unique` [L] is given."""
        overflow = 0.0 if unique is None or not self.overflow_ms else self.overflow_ms * float(self.overflow(unique).sum())
        return float(self.layer_ms(misses).sum()) + overflow

    def miss_price(self, misses, added: float = 1.0) -> np.ndarray:
        """[L] ms per further miss in each layer, once M_l misses are already being read: the mean slope
        of m_l over the next `added` misses (parallel reads make later misses cheaper)."""
        misses = np.asarray(misses, dtype=np.float64)
        return (self.layer_ms(misses + added) - self.layer_ms(misses)) / added

    def to_dict(self) -> dict:
        return {"formula": "ms = scale * m_l(M_l), linear between measured counts, + overflow_ms * max(U_l - capacity, 0)",
                "counts": list(self.counts), "ms": [list(row) for row in self.ms], "tier": self.tier,
                "bytes_per_expert": self.bytes_per_expert, "overflow_ms": self.overflow_ms, "capacity": self.capacity,
                "scale": self.scale}

    @staticmethod
    def from_dict(data: dict) -> "FetchCost":
        capacity = data.get("capacity")
        return FetchCost(tuple(int(c) for c in data["counts"]), tuple(tuple(float(v) for v in row) for row in data["ms"]),
                         str(data.get("tier", "disk")), int(data.get("bytes_per_expert", 0)),
                         float(data.get("overflow_ms", 0.0)), None if capacity is None else int(capacity),
                         float(data.get("scale", 1.0)))

    def times(self, factor: float) -> "FetchCost":
        """This cost with every read and the overflow price times `factor` >= 0 (what a run measures
        its reads to cost against this price, `CostCorrection.fetch_scale`)."""
        return replace(self, scale=self.scale * factor, overflow_ms=self.overflow_ms * factor)

    def at_capacity(self, capacity: int | None) -> "FetchCost":
        """This cost priced for a cache of `capacity` resident experts per layer (the run's, which may
        differ from the one the profile measured at)."""
        return replace(self, capacity=capacity)
