"""`BudgetBandit`: an online choice among a few ways of drafting, each judged by the throughput
measured when it decided a step.

The arms are fixed budgets (plain decoding, `static:N`) and the cost model's own per-step sizing.
Each arm keeps the last `window` steps it decided, as (tokens, ms) pairs, and its rate is their
ratio of sums (a step's rate swings with its accepted length, so an average of per-step rates
would be dominated by the short steps). The next arm is the one of highest upper confidence bound
(sliding-window UCB, Garivier and Moulines 2011: rate plus a bonus of `exploration` per-step
standard deviations times sqrt(log of the plays in the windows / the arm's plays)), so over a run the regret against the best arm
in hindsight grows like the log of the steps, not with them: the controller is never far below
the best constant budget, and the sizing decides only where it measurably pays in this run.

The statistics persist across `generate` calls of one process, per regime (`RegimeKey`: the
sampling settings and the batch's row count in powers of two), because which arm wins is a
property of the target, drafter, machine and regime, not of one request: a new request starts
from what the earlier ones measured. The arms' order is the prior: each decides `min_plays` steps,
in that order, before any is judged.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple


class RegimeKey(NamedTuple):
    """What makes arms' rates comparable: the sampling settings and the batch's rows (bucketed)."""

    temperature: float
    top_k: int
    top_p: float
    rows: int  # the batch's rows rounded up to a power of two

    @classmethod
    def of(cls, sampling, rows: int) -> "RegimeKey":
        return cls(float(sampling.temperature), int(sampling.top_k), float(sampling.top_p), 1 << max(rows - 1, 0).bit_length())


@dataclass
class ArmWindow:
    """The last `window` steps one arm decided, as (tokens, ms), with running sums so that a step's
    choice costs O(arms), not O(steps) (it runs inside every step's plan)."""

    window: int = 32
    steps: deque = field(default_factory=deque)
    _sums: list = field(default_factory=lambda: [0.0] * 5)  # sum t, ms, t^2, t ms, ms^2

    def add(self, tokens: float, ms: float) -> None:
        self.steps.append((tokens, ms))
        self._move(tokens, ms, 1.0)
        if len(self.steps) > self.window:
            self._move(*self.steps.popleft(), -1.0)

    def _move(self, t: float, ms: float, sign: float) -> None:
        for k, term in enumerate((t, ms, t * t, t * ms, ms * ms)):
            self._sums[k] += sign * term

    @property
    def plays(self) -> int:
        return len(self.steps)

    @property
    def tokens(self) -> float:
        return self._sums[0]

    @property
    def ms(self) -> float:
        return self._sums[1]

    @property
    def rate(self) -> float:
        """Tokens per ms over the window (a ratio of sums)."""
        return self._sums[0] / self._sums[1]

    def relative_spread(self) -> float | None:
        """The per-step standard deviation of the ratio estimator, relative to the rate (None
        before two steps): sqrt(sum (t - r ms)^2 / (n - 1)) / (r mean ms)."""
        n = len(self.steps)
        if n < 2:
            return None
        tokens, ms, t2, tm, m2 = self._sums
        rate = tokens / ms
        spread = max(t2 - 2 * rate * tm + rate * rate * m2, 0.0) / (n - 1)
        return math.sqrt(spread) / (rate * ms / n) if rate > 0 else None


class BudgetBandit:
    """Sliding-window UCB over `arms` (names), per `RegimeKey`; see the module docstring.

    `exploration` (c) scales the confidence bonus: the index of arm a is r_a + c r s sqrt(log n / n_a),
    with r the pooled rate of every arm's window, s the plays-weighted mean of the arms' per-step
    relative spreads, n the plays in all windows and n_a the arm's.
    """

    def __init__(self, arms: tuple[str, ...], exploration: float = 0.7, window: int = 32, min_plays: int = 3):
        if not arms:
            raise ValueError("a bandit needs at least one arm")
        self.arms = tuple(arms)
        self.exploration = exploration
        self.window = window
        self.min_plays = min_plays  # steps each arm decides before any is judged
        self._windows: dict[RegimeKey, dict[str, ArmWindow]] = {}

    def windows(self, key: RegimeKey) -> dict[str, ArmWindow]:
        if key not in self._windows:
            self._windows[key] = {arm: ArmWindow(self.window) for arm in self.arms}
        return self._windows[key]

    def choose(self, key: RegimeKey, allowed: tuple[str, ...] | None = None) -> str:
        """The arm to decide the next step: the first never played (in `arms` order), else the
        highest upper confidence bound; `allowed` restricts the choice (None: every arm)."""
        windows = self.windows(key)
        candidates = [arm for arm in self.arms if allowed is None or arm in allowed]
        for arm in candidates:
            if windows[arm].plays < self.min_plays:
                return arm
        total = sum(windows[arm].plays for arm in candidates)
        # the bonus is on one scale for every arm (the pooled rate times the pooled relative
        # spread): a bonus relative to an arm's own rate never lifted an arm whose first steps were
        # unlucky back into play
        scale = self._pooled_rate(windows, candidates) * self._pooled_spread(windows, candidates)
        log_term = math.log(max(total, 2))

        def index(arm: str) -> float:
            window = windows[arm]
            return window.rate + self.exploration * scale * math.sqrt(log_term / window.plays)

        return max(candidates, key=index)

    @staticmethod
    def _pooled_rate(windows: dict[str, ArmWindow], arms: list[str]) -> float:
        """Tokens per ms over every arm's window together."""
        return sum(windows[arm].tokens for arm in arms) / sum(windows[arm].ms for arm in arms)

    @staticmethod
    def _pooled_spread(windows: dict[str, ArmWindow], arms: list[str]) -> float:
        """The plays-weighted mean of the arms' relative spreads (1.0 before any arm has two steps)."""
        weighted = plays = 0.0
        for arm in arms:
            spread = windows[arm].relative_spread()
            if spread is not None:
                weighted += spread * windows[arm].plays
                plays += windows[arm].plays
        return weighted / plays if plays else 1.0

    def record(self, key: RegimeKey, arm: str, tokens: float, ms: float) -> None:
        """What a step `arm` decided made (tokens, expected where known) and cost (ms, all of it)."""
        if ms <= 0:
            return
        self.windows(key)[arm].add(tokens, ms)

    def rates(self, key: RegimeKey) -> dict[str, float]:
        """Each played arm's measured rate in this regime (tokens per ms)."""
        return {arm: window.rate for arm, window in self.windows(key).items() if window.plays}
