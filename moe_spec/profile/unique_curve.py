"""The unique-experts curve: how many distinct experts per MoE layer T verified tokens activate.

Measured by the profiler (`moe_spec.measure.routing_stats.unique_experts_curve`) on the best-first
T nodes of real draft trees and, as a baseline, on T tokens drawn at random from the decoded
text. The `truncate` controller prices a pass by its token count alone through `real_at`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class UniqueExpertsCurve:
    sizes: tuple[int, ...]  # [S] T, increasing
    real: np.ndarray  # [S, L] mean unique experts over best-first prefixes of real trees (nan: no tree that large)
    real_trees: tuple[int, ...]  # [S] trees contributing to each size
    random: np.ndarray  # [S, L] mean unique experts over T random decoded tokens

    def __post_init__(self):
        object.__setattr__(self, "sizes", tuple(int(s) for s in self.sizes))
        object.__setattr__(self, "real_trees", tuple(int(n) for n in self.real_trees))
        object.__setattr__(self, "real", np.asarray(self.real, dtype=np.float64))
        object.__setattr__(self, "random", np.asarray(self.random, dtype=np.float64))
        count = len(self.sizes)
        if not count or any(s < 1 for s in self.sizes) or any(b <= a for a, b in zip(self.sizes, self.sizes[1:])):
            raise ValueError(f"curve sizes must be positive and increasing, got {self.sizes}")
        if self.real.ndim != 2 or self.real.shape[0] != count or self.random.shape != self.real.shape:
            raise ValueError(f"curve needs real and random of shape [{count}, L], got {self.real.shape}, {self.random.shape}")
        if len(self.real_trees) != count:
            raise ValueError(f"curve needs {count} tree counts, got {len(self.real_trees)}")

    @property
    def num_layers(self) -> int:
        return self.real.shape[1]

    def real_at(self, num_tokens: float) -> np.ndarray:
        """[L] unique experts of the best-first `num_tokens` nodes of a real tree: linear between the
        measured sizes, held at the end values beyond them (sizes no tree reached are skipped)."""
        known = ~np.isnan(self.real).any(axis=1)
        if not known.any():
            raise ValueError("the unique-experts curve has no size that a real tree reached")
        sizes, real = np.asarray(self.sizes, dtype=np.float64)[known], self.real[known]
        return np.array([np.interp(num_tokens, sizes, real[:, layer]) for layer in range(self.num_layers)])

    def to_dict(self) -> dict:
        return {"sizes": list(self.sizes), "real": self.real.tolist(), "real_trees": list(self.real_trees),
                "random": self.random.tolist()}

    @staticmethod
    def from_dict(data: dict) -> "UniqueExpertsCurve":
        """Inverse of `to_dict`, after JSON (which stores nan as null)."""
        real = [[np.nan if v is None else float(v) for v in row] for row in data["real"]]
        return UniqueExpertsCurve(tuple(data["sizes"]), np.array(real), tuple(data["real_trees"]), np.array(data["random"]))

    def __eq__(self, other) -> bool:
        if not isinstance(other, UniqueExpertsCurve):
            return NotImplemented
        return (self.sizes == other.sizes and self.real_trees == other.real_trees
                and np.array_equal(self.real, other.real, equal_nan=True) and np.array_equal(self.random, other.random))

    __hash__ = None
