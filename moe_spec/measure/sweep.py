"""The latency sweep's timed passes, as data: what the cost model is fitted and judged on.

Three kinds of pass are timed in one interleaved sweep (`profiler.py`):
- "grid": a random tree of T tokens with routing forced to U experts in every layer (fitted on);
- "natural": a recorded draft tree on its own context, split "fit" / "heldout" by prompt;
- "batched": B recorded trees in one padded pass (T = B x width tokens), split "fit" / "heldout".

`LatencySweep.to_dict` is the profile's `details["latency"]` summary; `from_dict` reads it back
(for figures of a saved profile).
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_spec.measure.latency import Timing
from moe_spec.profile.cost_model import CostSample

KINDS = ("grid", "natural", "batched")


@dataclass(frozen=True)
class TimedPass:
    kind: str  # one of KINDS
    split: str  # "fit" or "heldout" (grid passes: always "fit")
    num_tokens: int  # T: tokens the pass computed, padding included
    unique_experts: tuple[int, ...]  # U per MoE layer, the union over rows
    rows: int  # B
    width: int  # slots per row (T / B)
    ms_median: float
    ms_min: float

    def __post_init__(self):
        if self.kind not in KINDS or self.split not in ("fit", "heldout"):
            raise ValueError(f"unknown timed pass kind {self.kind!r} or split {self.split!r}")

    @staticmethod
    def of(kind: str, split: str, num_tokens: int, timing: Timing, rows: int = 1, width: int | None = None,
           unique: tuple[int, ...] | None = None) -> "TimedPass":
        """A pass from its timing; U is what the timed pass activated unless given."""
        unique = timing.unique_experts if unique is None else unique
        return TimedPass(kind, split, int(num_tokens), tuple(int(u) for u in unique), rows,
                         num_tokens if width is None else width, timing.median_ms, timing.min_ms)

    def ms(self, statistic: str) -> float:
        return self.ms_median if statistic == "median" else self.ms_min

    def sample(self, statistic: str) -> CostSample:
        return CostSample(self.num_tokens, self.unique_experts, self.ms(statistic), self.rows)


@dataclass(frozen=True)
class LatencySweep:
    statistic: str  # of the repeats: "min" or "median"
    prefix_len: int  # cached context under the grid and batched passes
    seconds: float
    passes: tuple[TimedPass, ...]

    def of_kind(self, kind: str, split: str | None = None) -> list[TimedPass]:
        return [p for p in self.passes if p.kind == kind and (split is None or p.split == split)]

    def samples(self, kind: str, split: str | None = None, statistic: str | None = None) -> list[CostSample]:
        return [p.sample(statistic or self.statistic) for p in self.of_kind(kind, split)]

    def fit_samples(self, statistic: str | None = None) -> list[CostSample]:
        """What the cost model is fitted on: every grid pass, the fitted natural and batched passes."""
        return (self.samples("grid", statistic=statistic) + self.samples("natural", "fit", statistic)
                + self.samples("batched", "fit", statistic))

    def to_dict(self) -> dict:
        def row(p: TimedPass, unique) -> dict:
            return {"T": p.num_tokens, "U": unique, "ms": p.ms(self.statistic), "ms_median": p.ms_median, "ms_min": p.ms_min}

        return {
            "statistic": self.statistic,
            "grid": [row(p, p.unique_experts[0] if p.unique_experts else 0) for p in self.of_kind("grid")],
            "natural_trees": [{**row(p, list(p.unique_experts)), "split": p.split} for p in self.of_kind("natural")],
            "batched_passes": [{**row(p, list(p.unique_experts)), "B": p.rows, "width": p.width, "split": f"batch-{p.split}"}
                               for p in self.of_kind("batched")],
            "prefix_len": self.prefix_len,
            "seconds": self.seconds,
        }

    @staticmethod
    def from_dict(data: dict, num_layers: int) -> "LatencySweep":
        """Inverse of `to_dict`; a grid pass forced the same U in each of the `num_layers` MoE layers."""
        def timed(kind: str, split: str, p: dict, unique, rows: int = 1, width: int | None = None) -> TimedPass:
            return TimedPass(kind, split, int(p["T"]), tuple(int(u) for u in unique), rows,
                             int(p["T"]) if width is None else width, float(p["ms_median"]), float(p["ms_min"]))

        passes = [timed("grid", "fit", p, (p["U"],) * num_layers) for p in data["grid"]]
        passes += [timed("natural", p["split"], p, p["U"]) for p in data["natural_trees"]]
        passes += [timed("batched", p["split"].removeprefix("batch-"), p, p["U"], int(p["B"]), int(p["width"]))
                   for p in data.get("batched_passes", [])]
        return LatencySweep(str(data.get("statistic", "min")), int(data.get("prefix_len", 0)), float(data.get("seconds", 0.0)),
                            tuple(passes))
