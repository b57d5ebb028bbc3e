"""Bounded corrections a controller learns during one `generate` call.

The profile is the prior; what the step actually accepted and what the verify pass actually
took refine it. Both corrections are multiplicative and clamped, so a few odd steps cannot drive
the controller to extremes; both reset per call unless the controller persists them.
"""

from __future__ import annotations

import math
from collections import deque
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
    """measured = scale * predicted + fetch_scale * fetch + row_ms * (B - 1), for the verify time
    of a pass of B rows.

    With one row, what the profile's formula misses at run time is mostly a machine running at
    another speed than when it was profiled (its clock, its neighbours' load, a thread count), and
    that scales every term alike: on this 2-core machine the shipped profile's plain pass of 13 ms
    measured 26 ms, and 20-node passes 2.3x their prediction. So one-row passes teach `scale`, an
    exponential moving average of log(measured / predicted), clamped to [low, high]; an additive
    offset there (what this was before) kept the marginal token and expert at the profile's price,
    half of what they cost, and the controller verified twice the nodes that paid.

    A batch's passes add per-row work the profile's prices do not see (attention over every row's
    own long prefix, which the profile's short prefixes hid: its fitted per-row term is 0), which
    does not grow with the drafted tokens: scaling every term by it made each drafted token of a
    16-row batch look dear and the controller fell below plain decoding (0.87-0.91x ar at B = 16).
    So passes of several rows teach `row_ms`, ms per row after the first (measured at B = 16 on the
    embedded pair: 11-17 ms a pass whatever the tree, 0.7-1.1 per row), a moving average of
    (measured - scale * predicted) / (B - 1) that starts at its first sample (from 0 it took five
    16-row steps, a third of a 32-token request, to learn the work, and verify was priced 8% under
    what it took), and leave the scale as the one-row passes set it. Per row, not per pass: a batch
    whose rows finish keeps the price of the rows it still has (a flat offset learnt at 16 rows
    priced a 3-row pass 11 ms too dear).

    Offloaded, a pass also reads its missing experts, which the profile's fetch cost prices
    (`fetch_ms`, given apart from the compute's `predicted_ms`). Reads do not move with the compute:
    on this machine's disk a pass's reads cost 2.0-2.5x the disk profile's price while its compute
    ran at 0.9-1.0x the profile's, and one scale fitted to whole passes put the compute at 1.4-1.7x
    and the reads at 1x (`scripts/fetch_price_fit.py`, docs/offload.md), so the sizing took nodes
    whose experts are resident for dear and misses for cheap. So one-row passes also teach
    `fetch_scale`, what a pass's predicted fetch time costs it: the fetch coefficient of a
    least-squares fit of measured on (predicted, fetch) over recent passes, in relative error (each
    pass's terms over its measured time), each pass's weight decaying by `fetch_memory` per later
    pass, shrunk towards 1 (the profile's price) by `fetch_shrink` of its own evidence and clamped
    to [low, high]. Passes vary in how much of their time is reads (plain warm passes few, a tree's
    first pass of a request many), which is what tells the two prices apart. The speed `scale` is
    learnt from what the pass measured beyond its reads at that price.
    """

    smoothing: float = 0.3
    low: float = 0.25
    high: float = 4.0
    log_scale: float = 0.0
    row_ms: float = 0.0
    row_samples: int = 0
    fetch_scale: float = 1.0
    fetch_memory: float = 0.95  # a pass's weight in the fetch fit, times this per later one-row pass (about 20 passes)
    fetch_shrink: float = 0.1  # the fit's fetch coefficient pulled towards 1 by this share of its evidence
    # the fetch fit's decayed sums over one-row passes, x = (predicted, fetch) / measured, y = 1:
    # sum x1^2, x1 x2, x2^2, x1, x2
    _fit: list = field(default_factory=lambda: [0.0] * 5, init=False, repr=False)

    def update(self, predicted_ms: float, measured_ms: float, rows: int = 1, fetch_ms: float = 0.0) -> None:
        """A pass of `rows` rows predicted to compute in `predicted_ms` and to read its missing
        experts in `fetch_ms` (the profile's prices) took `measured_ms`."""
        if predicted_ms <= 0 or measured_ms <= 0:
            return
        fetch_ms = max(fetch_ms, 0.0)
        if rows > 1:
            per_row = (measured_ms - self.scale * predicted_ms - self.fetch_scale * fetch_ms) / (rows - 1)
            self.row_ms = per_row if not self.row_samples else (1 - self.smoothing) * self.row_ms + self.smoothing * per_row
            self.row_samples += 1
            return
        self._learn_fetch(predicted_ms / measured_ms, fetch_ms / measured_ms)
        computed = measured_ms - self.fetch_scale * fetch_ms
        if computed <= 0:  # reads priced above the whole pass: the slowest speed the clamp allows
            computed = self.low * predicted_ms
        ratio = math.log(computed / predicted_ms)
        blended = (1 - self.smoothing) * self.log_scale + self.smoothing * ratio
        self.log_scale = min(max(blended, math.log(self.low)), math.log(self.high))

    def _learn_fetch(self, compute: float, fetch: float) -> None:
        """One pass's relative terms into the decayed fit, and `fetch_scale` re-solved. Passes that
        all read in one proportion of their compute do not tell the two prices apart: the shrink
        then keeps the profile's price and the speed takes the rest."""
        fit = self._fit
        for k, term in enumerate((compute * compute, compute * fetch, fetch * fetch, compute, fetch)):
            fit[k] = self.fetch_memory * fit[k] + term
        s11, s12, s22, s1, s2 = fit
        if s22 <= 0:
            return  # no pass has read: the profile's price stands
        ridge = self.fetch_shrink * s22
        det = s11 * (s22 + ridge) - s12 * s12
        if det <= 1e-9 * s11 * s22:
            return  # numerically singular: the price stands
        solved = (s11 * (s2 + ridge) - s12 * s1) / det
        self.fetch_scale = min(max(solved, self.low), self.high)

    @property
    def scale(self) -> float:
        return math.exp(self.log_scale)

    def offset_ms(self, rows: int) -> float:
        """The per-row work learnt for a pass of `rows` rows (0 for one row)."""
        return self.row_ms * (rows - 1)


@dataclass
class ThroughputTracker:
    """Measured tokens per ms: of the last `window` speculative steps (a ratio of sums), and of
    plain steps (a moving average).

    A ratio of sums over a window, not a moving average of per-step rates: a step's rate swings
    with its accepted length (a 40 ms step makes 1 token or 5), and an average that a single probe
    after a pause could replace (what this was before) kept drafting off after any unlucky probe,
    13% of steps on the shipped greedy prompts where every fixed tree beat plain decoding by 1.3x.
    Probes add to the window instead, so the gate reopens once the window, not one step, says so.
    The gate closes only when the window's rate is below plain decoding's by more than its own
    standard error (`confidence`).
    """

    smoothing: float = 0.25
    margin: float = 0.97  # speculation must keep at least this share of plain decoding's rate
    window: int = 8
    min_speculative_steps: int = 4  # before the gate may close
    # the gate closes once the window's rate is below plain's by this many standard errors: a
    # window of 4-8 steps at temperature 1 (0-3 tokens accepted each) would otherwise close it on
    # luck alone about one check in five where speculation paid 1.2x
    confidence: float = 1.0
    plain: float | None = None
    speculative_steps: int = 0
    recent: deque = field(default_factory=deque)  # (tokens, ms) of the last `window` speculative steps

    def update(self, speculated: bool, tokens: int, ms: float) -> None:
        if ms <= 0:
            return
        if speculated:
            self.speculative_steps += 1
            self.recent.append((tokens, ms))
            if len(self.recent) > self.window:
                self.recent.popleft()
        else:
            rate = tokens / ms
            self.plain = rate if self.plain is None else (1 - self.smoothing) * self.plain + self.smoothing * rate

    @property
    def speculative(self) -> float | None:
        """Tokens per ms of the window's speculative steps; None before any."""
        if not self.recent:
            return None
        return sum(t for t, _ in self.recent) / sum(ms for _, ms in self.recent)

    def speculation_loses(self, plain_ms: float | None = None, plain_rate: float | None = None) -> bool:
        """Whether speculative steps made fewer tokens per ms than `margin` times plain ones; before
        a plain step is measured, a predicted plain rate stands in for them: `plain_rate` tokens per
        ms, or one token per `plain_ms`."""
        if plain_rate is None and plain_ms:
            plain_rate = 1.0 / plain_ms
        plain = self.plain if self.plain is not None else plain_rate
        if len(self.recent) < self.min_speculative_steps or plain is None:
            return False
        speculative = self.speculative
        if speculative >= self.margin * plain:  # the standard error (>= 0) cannot change the verdict
            return False
        return speculative + self.confidence * self.standard_error() < self.margin * plain

    def standard_error(self) -> float:
        """Standard error of the window's ratio of sums (the linearised ratio estimator): how far a
        window of a few steps' luck may sit from the rate its trees make."""
        n = len(self.recent)
        rate = self.speculative
        mean_ms = sum(ms for _, ms in self.recent) / n
        spread = sum((t - rate * ms) ** 2 for t, ms in self.recent) / (n - 1)
        return math.sqrt(spread / n) / mean_ms


@dataclass
class DraftCostTracker:
    """The draft time of a step as `fixed_ms + per_depth_ms * depth`, from recent drafts.

    A least-squares line through the last `window` (depth, ms) measurements. Given a prior slope
    (the profile's per-depth draft time at the speed measured), the slope is shrunk towards it as
    if `prior_weight` units of depth spread (sum of (d - mean d)^2) had measured it: drafts that
    all reach one or two depths cannot tell the depth's price from the fixed part, and the whole
    time spread over the depths priced a chain's node at 3-4 ms where it added 2.3 (sampled chains
    of 2-3 nodes, this 2-core machine). Without a prior, before two depths are seen the whole time
    is spread over the depths (which errs on the dear side). The slope is kept between `min_share`
    of that average and the average itself, so a noisy fit cannot make depth look free.
    """

    window: int = 16
    min_share: float = 0.3
    prior_weight: float = 2.0
    samples: list[tuple[int, float]] = field(default_factory=list)

    def update(self, depth: int, ms: float) -> None:
        if depth > 0 and ms > 0:
            self.samples = (self.samples + [(depth, ms)])[-self.window:]

    def estimate(self, prior_slope: float | None = None) -> tuple[float, float]:
        """(fixed_ms, per_depth_ms); (0, 0) before any measurement. Computed once per window and
        prior (a controller reads it more than once a step)."""
        cached = self.__dict__.get("_estimate")  # (samples, prior, estimate): `update` replaces the list
        if cached is not None and cached[0] is self.samples and cached[1] == prior_slope:
            return cached[2]
        out = self._fit(prior_slope)
        self.__dict__["_estimate"] = (self.samples, prior_slope, out)
        return out

    def _fit(self, prior_slope: float | None) -> tuple[float, float]:
        if not self.samples:
            return 0.0, 0.0
        n = len(self.samples)
        sum_d = sum_t = sum_rate = 0.0
        for d, ms in self.samples:
            sum_d += d
            sum_t += ms
            sum_rate += ms / d
        average, mean_d, mean_t = sum_rate / n, sum_d / n, sum_t / n
        spread = covariance = 0.0
        for d, ms in self.samples:
            spread += (d - mean_d) ** 2
            covariance += (d - mean_d) * (ms - mean_t)
        if prior_slope is not None and prior_slope > 0:
            slope = (covariance + self.prior_weight * prior_slope) / (spread + self.prior_weight)
        elif spread == 0.0:  # one depth seen: the slope is not identified
            return 0.0, average
        else:
            slope = covariance / spread
        slope = min(max(slope, self.min_share * average), average)
        return max(mean_t - slope * mean_d, 0.0), slope
