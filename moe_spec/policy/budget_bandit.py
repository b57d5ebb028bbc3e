"""`BudgetBandit`: an online choice among a few ways of drafting, each judged by the throughput
measured when it decided a step, and by what other steps tell of it.

The arms are fixed budgets (plain decoding, `static:N`) and the cost model's own per-step sizing.
An arm's rate is its mean tokens a step over its mean ms a step (a step's rate swings with its
accepted length, so an average of per-step rates would be dominated by the short steps). Its ms
come from the last `window` steps it decided; its tokens from the last `2 window` steps that tell
them: those it decided and those that *credit* it, where another arm's step tells exactly what this
arm would have made (a greedy step of N nodes tells every smaller fixed budget's tokens,
`moe_spec.policy.fewer_nodes`; any step tells plain decoding's: one a row). A step's time varies
far less than its tokens, so credited arms are known after a few steps of their own, and the
budgets are compared on the same steps rather than each on its own prompts.

The next arm is the one of highest upper confidence bound (sliding-window UCB, Garivier and
Moulines 2011: rate plus `exploration` standard errors of the rate, each times sqrt(log of the
plays in the windows)), so over a run the regret against the best arm in hindsight grows like the
log of the steps, not with them: the controller is never far below the best constant budget, and
the sizing decides only where it measurably pays in this run.

The statistics persist across `generate` calls of one process, per regime (`RegimeKey`: the
sampling settings and the batch's row count in powers of two), because which arm wins is a
property of the target, drafter, machine and regime, not of one request: a new request starts
from what the earlier ones measured. The arms' order is the prior: each decides `min_plays` steps,
in that order, before any is judged.
"""

from __future__ import annotations

import math
from collections import deque
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


class RunningWindow:
    """The last `size` values of one quantity, with running sums of them and their squares, so
    that a step's choice costs O(arms), not O(steps) (it runs inside every step's plan)."""

    def __init__(self, size: int):
        self.size = size
        self.values: deque = deque()
        self._sum = self._squares = 0.0

    def add(self, value: float) -> None:
        self.values.append(value)
        self._sum += value
        self._squares += value * value
        if len(self.values) > self.size:
            old = self.values.popleft()
            self._sum -= old
            self._squares -= old * old

    def __len__(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        return self._sum / len(self.values)

    def relative_spread(self) -> float | None:
        """The values' standard deviation over their mean (None before two values or at mean 0)."""
        n = len(self.values)
        if n < 2 or self._sum <= 0:
            return None
        mean = self._sum / n
        return math.sqrt(max(self._squares / n - mean * mean, 0.0) * n / (n - 1)) / mean


class ArmWindow:
    """One arm's evidence: the ms of the last `window` steps it decided, and the tokens of the last
    `2 window` steps that tell its tokens (its own and those that credit it)."""

    def __init__(self, window: int = 32):
        self.ms_window = RunningWindow(window)
        self.tokens_window = RunningWindow(2 * window)

    def add(self, tokens: float, ms: float) -> None:
        """A step the arm decided."""
        self.ms_window.add(ms)
        self.tokens_window.add(tokens)

    def credit(self, tokens: float) -> None:
        """What the arm would have made on a step another arm decided."""
        self.tokens_window.add(tokens)

    @property
    def plays(self) -> int:
        """Steps in the window that the arm decided."""
        return len(self.ms_window)

    @property
    def rate(self) -> float:
        """Mean tokens a step over mean ms a step."""
        return self.tokens_window.mean / self.ms_window.mean


class BudgetBandit:
    """Sliding-window UCB over `arms` (names), per `RegimeKey`; see the module docstring.

    `exploration` (c) scales the confidence bonus: the index of arm a is
    r_a + c r sqrt(log n (s_t^2 / t_a + s_m^2 / n_a)), with r the pooled rate of every arm's window,
    s_t and s_m the pooled relative spreads of a step's tokens and of its ms, t_a the arm's
    token evidence, n_a its plays and n the plays in all windows.
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
        """The arm to decide the next step: the first with fewer than `min_plays` plays (in `arms`
        order), else the highest upper confidence bound; `allowed` restricts the choice (None: every arm)."""
        windows = self.windows(key)
        candidates = [arm for arm in self.arms if allowed is None or arm in allowed]
        for arm in candidates:
            if windows[arm].plays < self.min_plays:
                return arm
        total = sum(windows[arm].plays for arm in candidates)
        # the bonus is on one scale for every arm (the pooled rate and spreads): a bonus relative
        # to an arm's own rate never lifted an arm whose first steps were unlucky back into play
        rate = self._pooled_rate(windows, candidates)
        tokens_spread = self._pooled_spread([windows[arm].tokens_window for arm in candidates])
        ms_spread = self._pooled_spread([windows[arm].ms_window for arm in candidates])
        log_term = math.log(max(total, 2))

        def index(arm: str) -> float:
            window = windows[arm]
            error = tokens_spread ** 2 / len(window.tokens_window) + ms_spread ** 2 / window.plays
            return window.rate + self.exploration * rate * math.sqrt(log_term * error)

        return max(candidates, key=index)

    @staticmethod
    def _pooled_rate(windows: dict[str, ArmWindow], arms: list[str]) -> float:
        """Tokens per ms over every arm's own steps together."""
        tokens = sum(windows[arm].tokens_window.mean * windows[arm].plays for arm in arms)
        return tokens / sum(windows[arm].ms_window.mean * windows[arm].plays for arm in arms)

    @staticmethod
    def _pooled_spread(runs: list[RunningWindow]) -> float:
        """The length-weighted mean of the windows' relative spreads (1.0 before any has two values)."""
        weighted = count = 0.0
        for run in runs:
            spread = run.relative_spread()
            if spread is not None:
                weighted += spread * len(run)
                count += len(run)
        return weighted / count if count else 1.0

    def record(self, key: RegimeKey, arm: str, tokens: float, ms: float,
               credits: dict[str, float] | None = None) -> None:
        """What a step `arm` decided made (tokens, expected where known) and cost (ms, all of it),
        and `credits`: arm -> the tokens that arm would have made on the same step, exactly."""
        if ms <= 0:
            return
        windows = self.windows(key)
        windows[arm].add(tokens, ms)
        for other, made in (credits or {}).items():
            if other != arm and other in windows:
                windows[other].credit(made)

    def rates(self, key: RegimeKey) -> dict[str, float]:
        """Each played arm's measured rate in this regime (tokens per ms)."""
        return {arm: window.rate for arm, window in self.windows(key).items() if window.plays}
