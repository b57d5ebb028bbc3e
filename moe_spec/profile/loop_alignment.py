"""The sweep's cost model mapped onto verify passes as the decode loop times them.

The forced-routing grid is what tells a token's cost from an expert's; the loop's own passes
(`moe_spec.measure.loop_passes`) are what a controller pays. The map keeps the grid's split and
takes level and slope from the loop: loop_ms ~ offset + factor * sweep_ms, so the aligned model is
base * factor + offset, every other term times factor. It is fitted by least squares on relative
error, once more after dropping passes that took far longer than the line says (a step the OS
interrupted: one such pass would move the fixed part for every size).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from moe_spec.profile.cost_model import CostModel, CostSample, predict_sample

MIN_PASSES = 8  # fewer, or passes all of one size: only the factor is fitted
OUTLIER_SPREAD = 4.0  # a pass whose relative residual is this many times the median's is left out of the refit


@dataclass(frozen=True)
class LoopMap:
    offset_ms: float  # added to the fixed part
    factor: float  # every term of the sweep's model times this
    passes: int  # loop passes fitted
    dropped: int  # of them left out as outliers

    def apply(self, model: CostModel) -> CostModel:
        """`model` with this map: the fixed part times factor plus offset, every other term times
        factor (the fetch cost, measured on the tier, unchanged)."""
        scaled = model.scaled(self.factor)
        return CostModel(scaled.base_ms + self.offset_ms, scaled.per_token_ms, scaled.per_expert_ms, scaled.num_layers,
                         scaled.source, scaled.per_row_ms, scaled.fetch)

    def to_dict(self) -> dict:
        return {"offset_ms": self.offset_ms, "factor": self.factor, "passes": self.passes, "dropped": self.dropped}


def fit_loop_map(model: CostModel, passes: Sequence[CostSample]) -> LoopMap:
    """The map from `model` (the sweep's) to `passes` timed in the loop. The aligned fixed part is
    kept >= 0 and the factor > 0: with too few passes, or passes of one size, only the factor."""
    if not passes:
        raise ValueError("cannot align a cost model to no loop passes")
    predicted = np.array([predict_sample(model, s) for s in passes])  # [S] ms
    measured = np.array([s.ms for s in passes])  # [S] ms
    if (predicted <= 0).any() or (measured <= 0).any():
        raise ValueError("loop passes and the model's times must be positive to align them")
    with_offset = len(passes) >= MIN_PASSES and predicted.max() > 1.5 * predicted.min()
    keep = np.ones(len(passes), dtype=bool)
    offset, factor = _fit(predicted, measured, keep, with_offset, model.base_ms)
    residual = np.abs(offset + factor * predicted - measured) / measured
    keep = residual <= OUTLIER_SPREAD * max(float(np.median(residual)), 1e-9)
    offset, factor = _fit(predicted, measured, keep, with_offset, model.base_ms)
    return LoopMap(offset, factor, len(passes), int((~keep).sum()))


def _fit(predicted: np.ndarray, measured: np.ndarray, keep: np.ndarray, with_offset: bool,
         base_ms: float) -> tuple[float, float]:
    """(offset, factor) minimising sum over kept passes of ((offset + factor * p - m) / m)^2."""
    p, m = predicted[keep], measured[keep]
    weight = 1.0 / m
    factor_only = float((p * weight * weight * m).sum() / (p * weight * p * weight).sum())
    if not with_offset:
        return 0.0, factor_only
    design = np.column_stack([weight, p * weight])  # [S', 2]: offset and factor columns, relative
    (offset, factor), *_ = np.linalg.lstsq(design, np.ones_like(m), rcond=None)
    if factor <= 0:
        return 0.0, factor_only
    if base_ms * factor + offset < 0:  # no negative fixed part: fitted with the aligned fixed part at 0
        variable = (p - base_ms) * weight  # [S'] the sweep's token and expert terms, relative (>= 0)
        if not (variable > 0).any():
            return 0.0, factor_only
        factor = float(variable.sum() / (variable * variable).sum())
        offset = -base_ms * factor
    return float(offset), float(factor)
