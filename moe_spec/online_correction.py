"""Bounded corrections a controller learns during one `generate` call.

The profile is the prior; what the step actually accepted and what the verify pass actually
took refine it. Both corrections are multiplicative and clamped, so a few odd steps cannot
drive the controller to extremes, and both reset per call unless the controller persists them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class AcceptanceCorrection:
    """Per-depth factor (prior + observed accepted) / (prior + predicted accepted), clamped."""

    prior_tokens: float = 2.0  # pseudo-count: how many expected tokens the profile is worth
    low: float = 0.1  # wide: a profile calibrated on greedy decoding overestimates acceptance under sampling
    high: float = 3.0
    observed: dict[int, float] = field(default_factory=dict)
    predicted: dict[int, float] = field(default_factory=dict)

    def update(self, depth: int, predicted: float, observed: float) -> None:
        self.predicted[depth] = self.predicted.get(depth, 0.0) + predicted
        self.observed[depth] = self.observed.get(depth, 0.0) + observed

    def factor(self, depth: int) -> float:
        ratio = (self.prior_tokens + self.observed.get(depth, 0.0)) / (self.prior_tokens + self.predicted.get(depth, 0.0))
        return min(max(ratio, self.low), self.high)


@dataclass
class CostCorrection:
    """Exponential moving average of log(measured / predicted) verify time, clamped."""

    smoothing: float = 0.2
    low: float = 0.5
    high: float = 2.0
    log_ratio: float = 0.0

    def update(self, predicted_ms: float, measured_ms: float) -> None:
        if predicted_ms > 0 and measured_ms > 0:
            step = math.log(measured_ms / predicted_ms)
            self.log_ratio = (1 - self.smoothing) * self.log_ratio + self.smoothing * step

    @property
    def factor(self) -> float:
        return min(max(math.exp(self.log_ratio), self.low), self.high)


@dataclass
class ThroughputTracker:
    """Moving averages of measured tokens per ms, for speculative steps and for plain steps."""

    smoothing: float = 0.25
    margin: float = 0.97  # speculation must keep at least this share of plain decoding's rate
    speculative: float | None = None
    plain: float | None = None
    speculative_steps: int = 0
    min_speculative_steps: int = 4  # before the gate may close
    paused: bool = False  # the last step was plain: the next speculative measurement replaces the average

    def update(self, speculated: bool, tokens: int, ms: float) -> None:
        if ms <= 0:
            return
        rate = tokens / ms
        self.speculative_steps += speculated
        if speculated:
            fresh = self.speculative is None or self.paused  # a probe after a pause: conditions have changed
            self.speculative = rate if fresh else (1 - self.smoothing) * self.speculative + self.smoothing * rate
            self.paused = False
        else:
            self.plain = rate if self.plain is None else (1 - self.smoothing) * self.plain + self.smoothing * rate
            self.paused = True

    def speculation_loses(self) -> bool:
        if self.speculative is None or self.plain is None or self.speculative_steps < self.min_speculative_steps:
            return False
        return self.speculative < self.margin * self.plain
