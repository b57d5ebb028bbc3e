"""One arm's evidence in a `BudgetBandit`: running windows of its steps' tokens and ms, the tokens
other steps credit it with, and (tokens, reference) pairs for judging it at the regime's difficulty.
Every statistic is kept as running sums, so that a step's choice costs O(arms), not O(steps): it
runs inside every step's plan.
"""

from __future__ import annotations

import math
from collections import deque

MIN_PAIRS = 8  # steps with a reference before an arm's tokens are adjusted to the regime's difficulty


class RunningWindow:
    """The last `size` values of one quantity, each stamped with the step that gave it, with their
    running sum."""

    def __init__(self, size: int):
        self.size = size
        self.values: deque = deque()
        self._steps: deque = deque()
        self._sum = 0.0

    def add(self, value: float, step: int = 0) -> None:
        self.values.append(value)
        self._steps.append(step)
        self._sum += value
        if len(self.values) > self.size:
            self._drop()

    def forget_before(self, step: int) -> None:
        """Drop the values given before `step`."""
        while self._steps and self._steps[0] < step:
            self._drop()

    def _drop(self) -> None:
        self._sum -= self.values.popleft()
        self._steps.popleft()

    def __len__(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        return self._sum / len(self.values)


class RequestDifficulty:
    """The difficulty of the request decoding now: the mean reference of its steps so far, shrunk
    towards the run's by `prior_steps` steps of it (a request's first few steps tell little of it)."""

    def __init__(self, prior_steps: float):
        if not prior_steps > 0:
            raise ValueError(f"prior_steps must be a positive number of steps, got {prior_steps}")
        self.prior_steps = prior_steps
        self._sum = 0.0
        self._count = 0

    def reset(self) -> None:
        """A new request begins."""
        self._sum, self._count = 0.0, 0

    def add(self, reference: float) -> None:
        self._sum += reference
        self._count += 1

    def at(self, run: float | None) -> float | None:
        """The request's difficulty given the run's (None: the run has none, nor has the request)."""
        if run is None:
            return None
        return (self._sum + self.prior_steps * run) / (self._count + self.prior_steps)


class PairedWindow:
    """The last `size` steps one arm decided, as (tokens, ms) pairs, with running sums (or of the
    steps that told its tokens, as (tokens, reference) pairs: `ArmWindow.referenced`)."""

    def __init__(self, size: int):
        self.size = size
        self.steps: deque = deque()
        self._stamps: deque = deque()  # the step index of each
        self._sums = [0.0] * 5  # sum t, ms, t^2, t ms, ms^2

    def add(self, tokens: float, ms: float, step: int = 0) -> None:
        self.steps.append((tokens, ms))
        self._stamps.append(step)
        self._move(tokens, ms, 1.0)
        if len(self.steps) > self.size:
            self._drop()

    def forget_before(self, step: int) -> None:
        """Drop the steps taken before `step`."""
        while self._stamps and self._stamps[0] < step:
            self._drop()

    def _drop(self) -> None:
        self._move(*self.steps.popleft(), -1.0)
        self._stamps.popleft()

    def _move(self, t: float, ms: float, sign: float) -> None:
        for k, term in enumerate((t, ms, t * t, t * ms, ms * ms)):
            self._sums[k] += sign * term

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def tokens(self) -> float:
        return self._sums[0]

    @property
    def ms(self) -> float:
        return self._sums[1]

    @property
    def mean_ms(self) -> float:
        return self._sums[1] / len(self.steps)

    def ratio_spread(self) -> float | None:
        """The per-step standard deviation of the ratio estimator tokens / ms, relative to the
        ratio (None before two steps): sqrt(sum (t - r ms)^2 / (n - 1)) / (r mean ms)."""
        n = len(self.steps)
        if n < 2:
            return None
        tokens, ms, t2, tm, m2 = self._sums
        rate = tokens / ms
        spread = max(t2 - 2 * rate * tm + rate * rate * m2, 0.0) / (n - 1)
        return math.sqrt(spread) / (rate * ms / n) if rate > 0 else None

    def slope(self) -> float | None:
        """The least-squares slope of tokens on the second quantity over the window's steps (None
        before two steps or where the second quantity does not vary)."""
        n = len(self.steps)
        if n < 2:
            return None
        tokens, other, _, cross, other2 = self._sums
        spread = other2 - other * other / n  # n times the second quantity's variance
        if spread <= 1e-12 * max(other2, 1.0):
            return None
        return (cross - tokens * other / n) / spread

    def ms_spread(self) -> float | None:
        """The steps' ms standard deviation over their mean (None before two steps)."""
        n = len(self.steps)
        if n < 2:
            return None
        ms, m2 = self._sums[1], self._sums[4]
        mean = ms / n
        return math.sqrt(max(m2 / n - mean * mean, 0.0) * n / (n - 1)) / mean


class ArmWindow:
    """One arm's evidence: the last `window` steps it decided (tokens and ms), the tokens of the
    last `window` steps that tell its tokens (its own, and those that credit it), and of those with
    a reference, (tokens, reference) pairs. Without credits or references the rate is the ratio of
    its own steps' sums."""

    def __init__(self, window: int = 32):
        self.own = PairedWindow(window)
        self.tokens_window = RunningWindow(window)
        self.referenced = PairedWindow(window)  # (tokens, reference) of told steps with a reference
        self.told = 0  # steps that ever told its tokens, forgotten or not

    def add(self, tokens: float, ms: float, step: int = 0, reference: float | None = None) -> None:
        """A step the arm decided (`step`: the regime's step count when it was taken)."""
        self.own.add(tokens, ms, step)
        self.credit(tokens, step, reference)

    def credit(self, tokens: float, step: int = 0, reference: float | None = None) -> None:
        """What the arm made, or would have made, on a step (another arm's: a credit)."""
        self.tokens_window.add(tokens, step)
        if reference is not None:
            self.referenced.add(tokens, reference, step)
        self.told += 1

    def forget_before(self, step: int) -> None:
        self.own.forget_before(step)
        self.tokens_window.forget_before(step)
        self.referenced.forget_before(step)

    def tokens_at(self, reference: float | None) -> float:
        """Mean tokens a step, adjusted to steps of mean `reference` (None: unadjusted)."""
        mean = self.tokens_window.mean
        slope = self.reference_slope()
        if reference is None or slope is None:
            return mean
        return max(mean + slope * (reference - self.mean_reference), 0.0)

    @property
    def mean_reference(self) -> float:
        """The mean reference of the told steps in the window that had one."""
        return self.referenced.mean_ms  # the pairs' second quantity

    def reference_slope(self) -> float | None:
        """The adjustment's slope: positive, from at least `MIN_PAIRS` referenced steps, or None."""
        if len(self.referenced) < MIN_PAIRS:
            return None
        slope = self.referenced.slope()
        return slope if slope is not None and slope > 0 else None

    def rate_at(self, reference: float | None) -> float:
        """Adjusted mean tokens a step (`tokens_at`) over mean ms a step."""
        return self.tokens_at(reference) / self.own.mean_ms

    @property
    def plays(self) -> int:
        """Steps in the window that the arm decided."""
        return len(self.own)
