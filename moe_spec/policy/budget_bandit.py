"""`BudgetBandit`: an online choice among a few ways of drafting, each judged by the throughput
measured when it decided a step, and by what other steps tell of it.

The arms are fixed budgets (plain decoding, `static:N`) and the cost model's own per-step sizing.
An arm's rate is its mean tokens a step over its mean ms a step (a step's rate swings with its
accepted length, so an average of per-step rates would be dominated by the short steps). Its ms
come from the last `window` steps it decided; its tokens from the last `window` steps that tell
them: those it decided and those that *credit* it, where another arm's step tells exactly what this
arm would have made (a greedy step of N nodes tells every smaller fixed budget's tokens,
`moe_spec.policy.fewer_nodes`; any step tells plain decoding's: one a row). A step's time varies
far less than its tokens, so credited arms are known after a few steps of their own, and the
budgets are compared on the same steps rather than each on its own prompts.

The next arm is the one of highest upper confidence bound (sliding-window UCB, Garivier and
Moulines 2011: rate plus `exploration` standard errors of the rate, each times sqrt(log of the
plays in the windows)): the controller stays near the best constant budget, and the sizing decides
only where it measurably pays in this run. With a `horizon`, evidence older than that many of the
regime's steps is forgotten, and an arm left with none is played once more, so an arm whose few
steps fell on a prompt that accepted little is tried again; the price is about a step per arm per
horizon. Without one (the default, see `HORIZON`) the regret against a best arm that does not
change grows like the log of the steps, but an arm judged on unlucky steps can stay unplayed.

The statistics persist across `generate` calls of one process, per regime (`RegimeKey`: the
sampling settings and the batch's row count in powers of two), because which arm wins is a
property of the target, drafter, machine and regime, not of one request: a new request starts
from what the earlier ones measured. Without a measured prior, the arms' order is the prior:
before any is judged, each decides steps in that order until `min_plays` steps told its tokens, at
least one of them its own (its time is known only from its own steps; a credited arm needs no more
of them to be judged).

A measured prior (`priors`: per regime, each arm's rate as the profile measured it on its own
prompts, `moe_spec.measure.arm_rates`) replaces that order: an arm it covers is judged with its
prior rate weighing as many of its own steps as have a standard error of `prior_error` of the rate
(the run's per-step spread of a rate over `prior_error`, squared: about 4 steps of one row, whose
accepted lengths swing, and a sixth of a step of a 16-row batch, whose steps average their rows);
its scale is the run's: the prior rates are multiplied by what the arms played so far
measured against them (the machine may run faster or slower than when profiled; the arms' ratios
are what carries over). So arms the profile found far worse are left alone, and arms near the best
are tried as their bonus says. Where one step outweighs a prior (a weight below one step: batches),
each arm it covers decides one step, the profile's best first, before any is judged by the bound,
since the ratios do not always carry over: where verifying more tokens and experts has grown dearer
since the profile (a busier memory bus, another thread count), the profile ranks the larger trees
too high; unplayed, a one-node tree it ranked 23% below the sizing was never tried in a 16-row batch
where it ran ahead of it, and a step of it there, its tokens averaged over 16 rows, tells its rate
within a few percent. The price is about a step per regime. One row's step tells too little for
that: an arm whose one step was unlucky would be judged below its prior's weight for good.

The ratios carry over only so far, and not alike for every arm: where the run's prompts accept
less than the profile's, or its misses cost more, the larger trees lose more against the profile
than the smaller ones. So where it is given each arm's tokens a step as the profile measured them
(`prior_tokens`; `BoundedController` gives them only with `tilt=True`, since live the tilt did not
beat one scale), the scale tilts with them: the log of measured over prior rate is fitted, over the
played arms, as a line in the log of their tokens a step, its slope shrunk towards none
(`tilt_spread`), and each arm the run has not judged yet is priced on that line. Once plain decoding and a one-node tree have
played, a four-node tree the profile ranked high is priced as far below as they tell.

A regime the profile did not measure starts from the nearest one it did, since the arms' order
changes slowly with the batch's rows and the sampling: a batch's rows finish at different steps, so
a 16-row batch ends through 8, 4, 2 and 1 rows, and each of those regimes, unmeasured, was explored
arm by arm while the rows that were left decoded. Rates are interpolated geometrically in log2 of
the rows between the measured row counts around it (the nearest where it lies outside them), of
the same sampling settings, else of the measured settings of the same kind (greedy or sampled)
nearest in temperature, then top-p (`prior_of`).

Requests differ in how much they accept far more than the arms do (a copied passage against random
text), so an arm judged on the requests it happened to decide is judged on their difficulty as much
as on its own worth. A step may therefore carry a `reference`: a measure of its difficulty that any
arm's step tells alike (the bounded controller gives the tokens its best drafted node alone makes,
`fewer_nodes`). An arm's mean tokens are then regression-adjusted to the regime's difficulty (the
mean reference of its last `REFERENCE_STEPS` steps): mean t + b (mean reference of the regime -
mean reference of the arm's told steps), b the slope of the arm's tokens on the reference over those
steps (positive; none before `MIN_PAIRS` of them). Plain decoding's tokens do not move with it
(b = 0), a deep tree's move most, and every arm is compared at the same difficulty: the run's, at
which a constant arm is best or not (the request decoding now's would chase each prompt on a slope
fitted from a few steps).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from moe_spec.policy.arm_windows import ArmWindow, RequestDifficulty, RunningWindow


# the defaults. A horizon of 128 steps (with a window of 64) took the bound from 0.83 to 0.93 of
# its best arm on replays of the shipped prompts' greedy trace (`scripts/bound_sweep.py`), where the
# sizing, best by 16%, had been judged on three unlucky steps and never tried again; live it measured
# no better greedy and 0.93-0.94 of the tuned tree under sampling against 0.96-1.08 without
# (analysis/results/controller_regimes/horizon128/): each forgotten arm's replay costs a step or more
# per horizon, and sampled or offloaded, the worst arms cost most. So evidence is kept by default.
EXPLORATION = 0.7
WINDOW = 32
MIN_PLAYS = 3
HORIZON = None
# how far a profile's rate of an arm may be from the run's, relative (its standard error): the
# arms' ratios carry over from the profile only so far (the machine's load, the prompts). 0.25
# weighs a prior as 4 steps where rates spread by 50% a step (the prior simulation's arms, where 4
# did best), 2-3 at T = 1 on the embedded pair (33-43%), a sixth of a 16-row batch's step (10%)
PRIOR_ERROR = 0.25
# how far the run may find the profile's arms' ratios tilted with how far they speculate: the prior
# standard deviation of the slope of log(run's rate / profile's rate) on log(tokens a step). On the
# embedded pair offloaded (16 resident), the profile's arm stage put static:1 at 1.23x plain decoding
# and static:4 at 1.15x, where the bench measured 0.98-1.05x and 0.89-0.94x: a slope of about -0.25
# for both (every expert resident, the same arms: 1.32x against 1.20x, 1.32x against 1.25x)
TILT_SPREAD = 0.5
# the regime's difficulty is the mean reference of this many of its last steps (within the horizon):
# the run's level, which each arm's constant rate is judged at, not the request decoding now's
REFERENCE_STEPS = 1024


class RegimeKey(NamedTuple):
    """What makes arms' rates comparable: the sampling settings and the batch's rows (bucketed)."""

    temperature: float
    top_k: int
    top_p: float
    rows: int  # the batch's rows rounded up to a power of two

    @classmethod
    def of(cls, sampling, rows: int) -> "RegimeKey":
        return cls(float(sampling.temperature), int(sampling.top_k), float(sampling.top_p), 1 << max(rows - 1, 0).bit_length())


class BudgetBandit:
    """Sliding-window UCB over `arms` (names), per `RegimeKey`; see the module docstring.

    `exploration` (c) scales the confidence bonus: the index of arm a is
    r_a + c r sqrt(log n ((s^2 - s_m^2) / t_a + s_m^2 / n_a)), with r the pooled rate of every arm's
    own steps, s the pooled relative spread of the ratio estimator over them (what the rate's error
    is per step decided, tokens and ms together), s_m that of a step's ms alone, t_a the steps that
    told the arm's tokens, n_a its own plays and n the plays in all windows. Without credits
    (t_a = n_a) the error is s^2 / n_a: a ratio of sums' own.
    """

    def __init__(self, arms: tuple[str, ...], exploration: float = EXPLORATION, window: int = WINDOW,
                 min_plays: int = MIN_PLAYS, horizon: int | None = HORIZON,
                 priors: dict[RegimeKey, dict[str, float]] | None = None, prior_error: float = PRIOR_ERROR,
                 adjust: bool = True, prior_tokens: dict[RegimeKey, dict[str, float]] | None = None,
                 tilt_spread: float = TILT_SPREAD):
        if not arms:
            raise ValueError("a bandit needs at least one arm")
        if horizon is not None and horizon < 1:
            raise ValueError(f"horizon must be a positive number of steps or None, got {horizon}")
        if not prior_error > 0:
            raise ValueError(f"prior_error must be a positive relative error, got {prior_error}")
        if not tilt_spread >= 0:
            raise ValueError(f"tilt_spread must be a standard deviation >= 0 (0: no tilt), got {tilt_spread}")
        self.arms = tuple(arms)
        # regime -> arm -> tokens per ms the profile measured (arms this bandit has, rates > 0)
        self.priors = {key: {arm: float(rate) for arm, rate in rates.items() if arm in self.arms and rate > 0}
                       for key, rates in (priors or {}).items()}
        # regime -> arm -> tokens a row made a step where the profile measured it (how far it speculates)
        self.prior_tokens = {key: {arm: float(t) for arm, t in tokens.items() if arm in self.arms and t >= 1}
                             for key, tokens in (prior_tokens or {}).items()}
        self.prior_error = prior_error
        self.tilt_spread = tilt_spread
        self._resolved: dict[tuple[str, RegimeKey], dict[str, float]] = {}  # `prior_of`, `prior_tokens_of`
        self.exploration = exploration
        self.window = window
        self.min_plays = min_plays  # steps that tell each arm's tokens before any is judged
        self.adjust = adjust  # arms' tokens adjusted to the regime's difficulty (references)
        self._references: dict[RegimeKey, RunningWindow] = {}  # the last `REFERENCE_STEPS` steps' references
        # evidence older than this many of the regime's steps is forgotten (None: kept until the
        # window drops it): an arm left unplayed is judged afresh, not forever by its old steps
        self.horizon = horizon
        self._windows: dict[RegimeKey, dict[str, ArmWindow]] = {}
        self._clock: dict[RegimeKey, int] = {}  # steps recorded per regime

    def windows(self, key: RegimeKey) -> dict[str, ArmWindow]:
        if key not in self._windows:
            self._windows[key] = {arm: ArmWindow(self.window) for arm in self.arms}
        return self._windows[key]

    def choose(self, key: RegimeKey, allowed: tuple[str, ...] | None = None, in_flight: tuple[str, ...] = (),
               difficulty: RequestDifficulty | None = None) -> str:
        """The arm to decide the next step: the first (in `arms` order) without a prior and with no
        play yet or fewer than `min_plays` steps that told its tokens, else, where one step outweighs
        a prior, the unplayed arm of best prior, else the highest upper confidence bound; `allowed`
        restricts the choice (None: every arm; it must leave one). `in_flight`: the arms of steps
        decided but not recorded yet (a caller that records a step once the next one has begun),
        each a play and a told step to the rules that try arms, so that none is tried twice over.
        `difficulty`: the request's, which the arms' rates are then judged at (None: the regime's)."""
        windows = self.windows(key)
        candidates = [arm for arm in self.arms if allowed is None or arm in allowed]
        if not candidates:
            raise ValueError(f"none of the bandit's arms {list(self.arms)} is allowed ({list(allowed or ())})")
        if self.horizon is not None:
            for arm in candidates:
                windows[arm].forget_before(self._clock.get(key, 0) - self.horizon)
        prior = self.prior_of(key)
        for arm in candidates:
            # an arm whose steps were all forgotten is played once again: it was judged before
            flying = in_flight.count(arm)
            if arm not in prior and (not windows[arm].plays + flying or windows[arm].told + flying < self.min_plays):
                return arm
        # what can be judged: arms played or with a prior (an unplayed one without is in flight)
        judged = [arm for arm in candidates if windows[arm].plays or arm in prior] or candidates[:1]
        total = sum(windows[arm].plays for arm in candidates)
        if not total:  # none has played: the profile's best (one in flight without a prior: no other)
            return max(judged, key=lambda arm: prior.get(arm, 0.0))
        # the bonus is on one scale for every arm (the pooled rate and spreads): a bonus relative
        # to an arm's own rate never lifted an arm whose first steps were unlucky back into play
        rate = self._pooled_rate(windows, candidates)
        ratio_spread = self._pooled([(windows[arm].own.ratio_spread(), windows[arm].plays) for arm in candidates])
        ms_spread = min(self._pooled([(windows[arm].own.ms_spread(), windows[arm].plays) for arm in candidates]),
                        ratio_spread)
        tokens_part = ratio_spread ** 2 - ms_spread ** 2  # the part of the error that credits shrink
        log_term = math.log(max(total, 2))
        reference = self.reference(key)
        if difficulty is not None:
            reference = difficulty.at(reference)
        rates = {arm: windows[arm].rate_at(reference) for arm in candidates if windows[arm].plays}
        scaled = self._scaled_prior(prior, self.prior_tokens_of(key), rates, windows, ratio_spread)
        prior_weight = (ratio_spread / self.prior_error) ** 2  # steps of the run's spread: the prior's error
        unplayed = [arm for arm in judged if not windows[arm].plays and arm not in in_flight]  # with priors
        if unplayed and prior_weight < 1:  # one step of an arm tells more than its prior: take it
            return max(unplayed, key=scaled.__getitem__)

        def index(arm: str) -> float:
            window, weight = windows[arm], prior_weight if arm in prior else 0.0
            if not window.plays:  # an arm with a prior only
                return scaled[arm] + self.exploration * rate * math.sqrt(log_term * ratio_spread ** 2 / weight)
            mean = (rates[arm] * window.plays + scaled[arm] * weight) / (window.plays + weight) if weight \
                else rates[arm]
            error = tokens_part / (len(window.tokens_window) + weight) + ms_spread ** 2 / (window.plays + weight)
            return mean + self.exploration * rate * math.sqrt(log_term * error)

        return max(judged, key=index)

    def prior_of(self, key: RegimeKey) -> dict[str, float]:
        """The arms' prior rates for `key`: its own measured ones, else those of the nearest measured
        regimes (see the module docstring; {} where none is of its kind)."""
        return self._resolve("rates", self.priors, key)

    def prior_tokens_of(self, key: RegimeKey) -> dict[str, float]:
        """The tokens a row made a step, per arm, where the profile measured `key` (or the nearest
        measured regimes, as `prior_of`; {} where the profile kept none)."""
        return self._resolve("tokens", self.prior_tokens, key)

    def _resolve(self, name: str, table: dict[RegimeKey, dict[str, float]], key: RegimeKey) -> dict[str, float]:
        if key in table:
            return table[key]
        if (name, key) not in self._resolved:
            self._resolved[name, key] = self._nearest(table, key)
        return self._resolved[name, key]

    @staticmethod
    def _nearest(table: dict[RegimeKey, dict[str, float]], key: RegimeKey) -> dict[str, float]:
        sampled = key.temperature > 0
        settings = {measured[:3] for measured in table if (measured.temperature > 0) == sampled}
        if not settings:
            return {}
        # (temperature, top_k, top_p): its own, else the nearest in temperature, then top-p, then top-k
        setting = min(settings, key=lambda s: (s != key[:3], abs(s[0] - key.temperature), abs(s[2] - key.top_p),
                                               abs(s[1] - key.top_k)))
        by_rows = {measured.rows: values for measured, values in table.items() if measured[:3] == setting}
        below = max((rows for rows in by_rows if rows <= key.rows), default=None)
        above = min((rows for rows in by_rows if rows >= key.rows), default=None)
        if below is None or above is None or below == above:
            return dict(by_rows[above if below is None else below])
        weight = math.log2(key.rows / below) / math.log2(above / below)  # 0 at `below`, 1 at `above`
        low, high = by_rows[below], by_rows[above]
        return {arm: low[arm] ** (1 - weight) * high[arm] ** weight for arm in low if arm in high}

    def scaled_prior(self, key: RegimeKey) -> dict[str, float]:
        """The arms' prior rates for `key` at the run's scale and tilt, as `choose` weighs them now."""
        windows = self.windows(key)
        played = [arm for arm in self.arms if windows[arm].plays]
        reference = self.reference(key)
        rates = {arm: windows[arm].rate_at(reference) for arm in played}
        spread = self._pooled([(windows[arm].own.ratio_spread(), windows[arm].plays) for arm in played])
        return self._scaled_prior(self.prior_of(key), self.prior_tokens_of(key), rates, windows, spread)

    def _scaled_prior(self, prior: dict[str, float], tokens: dict[str, float], rates: dict[str, float],
                      windows: dict[str, ArmWindow], ratio_spread: float) -> dict[str, float]:
        """Each `prior` rate times what the run measures against the profile (`rates`: the played
        arms' measured rates): where `tokens` holds every prior arm's tokens a step, a scale that
        tilts with them (`_tilted_scales`), else one scale for all (`_prior_scale`)."""
        if self.tilt_spread > 0 and prior and all(arm in tokens for arm in prior):
            scales = self._tilted_scales(rates, windows, prior, tokens, ratio_spread)
            return {arm: scales[arm] * rate for arm, rate in prior.items()}
        scale = self._prior_scale(rates, windows, prior)
        return {arm: scale * rate for arm, rate in prior.items()}

    def _tilted_scales(self, rates: dict[str, float], windows: dict[str, ArmWindow], prior: dict[str, float],
                       tokens: dict[str, float], ratio_spread: float) -> dict[str, float]:
        """Per prior arm, exp(a + b (x - mean x)), x the log of its tokens a step: a and b the
        plays-weighted least-squares fit, over the played arms with a prior, of the log of measured
        rate / prior rate on x, with b shrunk towards 0 as if a slope had a standard deviation of
        `tilt_spread` before the run (ridge: the run's per-step spread squared over tilt_spread
        squared), so that two arms' few steps do not tilt it far. 1.0 for every arm before any of
        them has played."""
        # an arm adjusted to no tokens at the run's difficulty (`rate_at`) has no log: it tells no tilt
        points = [(math.log(tokens[arm]), math.log(rate / prior[arm]), windows[arm].plays)
                  for arm, rate in rates.items() if arm in prior and rate > 0]
        weight = sum(w for _, _, w in points)
        if not weight:
            return dict.fromkeys(prior, 1.0)
        mean_x = sum(x * w for x, _, w in points) / weight
        mean_y = sum(y * w for _, y, w in points) / weight
        spread = sum(w * (x - mean_x) ** 2 for x, _, w in points)
        cross = sum(w * (x - mean_x) * (y - mean_y) for x, y, w in points)
        slope = cross / (spread + (ratio_spread / self.tilt_spread) ** 2)
        return {arm: math.exp(mean_y + slope * (math.log(tokens[arm]) - mean_x)) for arm in prior}

    @staticmethod
    def _prior_scale(rates: dict[str, float], windows: dict[str, ArmWindow], prior: dict[str, float]) -> float:
        """What the run measures against the profile: the plays-weighted mean, over played arms
        (`rates`: arm -> its measured rate) with a prior, of measured rate / prior rate (1.0 before
        any of them has played)."""
        measured = plays = 0.0
        for arm, rate in rates.items():
            if arm in prior:
                measured += windows[arm].plays * rate / prior[arm]
                plays += windows[arm].plays
        return measured / plays if plays else 1.0

    @staticmethod
    def _pooled_rate(windows: dict[str, ArmWindow], arms: list[str]) -> float:
        """Tokens per ms over every arm's own steps together."""
        return sum(windows[arm].own.tokens for arm in arms) / sum(windows[arm].own.ms for arm in arms)

    @staticmethod
    def _pooled(spreads: list[tuple[float | None, int]]) -> float:
        """The plays-weighted mean of the arms' spreads (1.0 before any arm has two steps)."""
        weighted = plays = 0.0
        for spread, count in spreads:
            if spread is not None:
                weighted += spread * count
                plays += count
        return weighted / plays if plays else 1.0

    def record(self, key: RegimeKey, arm: str, tokens: float, ms: float,
               credits: dict[str, float] | None = None, reference: float | None = None) -> None:
        """What a step `arm` decided made (tokens, expected where known) and cost (ms, all of it),
        `credits`: arm -> the tokens that arm would have made on the same step, exactly, and the
        step's `reference` (its difficulty as any arm's step tells it alike; None: not told)."""
        if ms <= 0:
            return
        windows = self.windows(key)
        step = self._clock.get(key, 0)
        self._clock[key] = step + 1
        reference = reference if self.adjust else None
        if reference is not None:
            self._references.setdefault(key, RunningWindow(REFERENCE_STEPS)).add(reference, step)
        windows[arm].add(tokens, ms, step, reference)
        for other, made in (credits or {}).items():
            if other != arm and other in windows:
                windows[other].credit(made, step, reference)

    def reference(self, key: RegimeKey) -> float | None:
        """The regime's difficulty: the mean reference of its last `REFERENCE_STEPS` steps with one,
        within the horizon (None: none)."""
        window = self._references.get(key)
        if window is not None and self.horizon is not None:
            window.forget_before(self._clock.get(key, 0) - self.horizon)
        return window.mean if window else None

    def rates(self, key: RegimeKey) -> dict[str, float]:
        """Each played arm's measured rate in this regime (tokens per ms), at its difficulty."""
        reference = self.reference(key)
        return {arm: window.rate_at(reference) for arm, window in self.windows(key).items() if window.plays}
