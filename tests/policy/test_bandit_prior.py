"""The bandit's measured prior: arms the profile measured are not played to be judged, the far worse
ones stay nearly unplayed, the prior's level is the run's (its ratios carry over, not its speed),
and a prior the run contradicts gives way to what the run measures."""

import random

import pytest

from moe_spec.policy.budget_bandit import BudgetBandit

from tests.policy.test_bounded_controller import ONE_ROW, _play

RATES = {"a": 0.7, "b": 1.0, "c": 0.5}


def test_with_a_prior_the_profiles_best_opens_and_far_worse_arms_stay_nearly_unplayed():
    for seed in range(5):
        with_prior = _play(BudgetBandit(("a", "b", "c"), priors={ONE_ROW: RATES}), RATES, 600, seed)
        without = _play(BudgetBandit(("a", "b", "c")), RATES, 600, seed)
        assert with_prior[0] == "b"
        assert with_prior.count("c") < without.count("c") and with_prior.count("c") <= 3, (with_prior.count("c"), seed)
        assert with_prior[:300].count("b") > without[:300].count("b")


def test_the_prior_carries_its_ratios_not_its_level():
    """Profiled on a machine twice as fast: every prior rate is double what the run measures."""
    doubled = {arm: 2 * rate for arm, rate in RATES.items()}
    for seed in range(5):
        chosen = _play(BudgetBandit(("a", "b", "c"), priors={ONE_ROW: doubled}), RATES, 600, seed)
        assert chosen.count("b") > 0.85 * 600 and chosen.count("c") <= 3, seed


def test_a_prior_the_run_contradicts_gives_way():
    wrong = {"a": 1.0, "b": 0.8, "c": 0.5}  # the profile's prompts favoured a; this run's favour b
    late = [_play(BudgetBandit(("a", "b", "c"), priors={ONE_ROW: wrong}), RATES, 1500, seed)[750:].count("b") / 750
            for seed in range(5)]
    assert min(late) > 0.7, late


def test_arms_the_prior_leaves_out_are_played_to_be_judged_and_other_regimes_keep_the_order():
    bandit = BudgetBandit(("a", "b", "c"), priors={ONE_ROW: {"b": 1.0, "c": 0.5, "z": 3.0}})
    assert bandit.priors[ONE_ROW] == {"b": 1.0, "c": 0.5}, "arms the bandit lacks are dropped"
    chosen = _play(bandit, RATES, 3)
    assert chosen == ["a"] * 3
    from moe_spec.core.sampling import SamplingConfig
    from moe_spec.policy.budget_bandit import RegimeKey
    sampled = RegimeKey.of(SamplingConfig(temperature=1.0), 1)
    assert _play(bandit, RATES, 9, key=sampled) == ["a"] * 3 + ["b"] * 3 + ["c"] * 3


def test_prior_error_must_be_positive():
    with pytest.raises(ValueError, match="prior_error"):
        BudgetBandit(("a",), prior_error=0)


def test_a_regime_the_profile_did_not_measure_starts_from_the_nearest_measured_ones():
    from moe_spec.core.sampling import GREEDY, SamplingConfig
    from moe_spec.policy.budget_bandit import RegimeKey

    def key(rows, temperature=0.0, top_p=1.0):
        return RegimeKey.of(SamplingConfig(temperature, top_p=top_p) if temperature else GREEDY, rows)

    priors = {key(1): {"a": 1.0, "b": 2.0}, key(4): {"a": 4.0, "b": 2.0, "c": 1.0}, key(16): {"a": 1.0, "b": 8.0, "c": 1.0},
              key(1, 1.0): {"a": 3.0}, key(1, 0.7, 0.9): {"b": 5.0}}
    bandit = BudgetBandit(("a", "b", "c"), priors=priors)
    assert bandit.prior_of(key(4)) == priors[key(4)], "a measured regime keeps its own"
    # 8 rows lie halfway (in log2 rows) between 4 and 16: the geometric mean; only arms both measured
    assert bandit.prior_of(key(8)) == pytest.approx({"a": 2.0, "b": 4.0, "c": 1.0})
    assert bandit.prior_of(key(2)) == pytest.approx({"a": 2.0, "b": 2.0})
    assert bandit.prior_of(key(32)) == priors[key(16)], "beyond the largest: the largest"
    # an unmeasured sampling setting: the nearest measured one of its kind, then its rows
    assert bandit.prior_of(key(1, 0.8)) == priors[key(1, 0.7, 0.9)]
    assert bandit.prior_of(key(4, 1.5)) == priors[key(1, 1.0)]
    assert BudgetBandit(("a", "b"), priors={key(1): {"a": 1.0}}).prior_of(key(1, 1.0)) == {}, "greedy is no prior for sampling"
    # opened by the nearest prior's best arm, not by trying each arm in order
    assert bandit.choose(key(8)) == "b" and bandit.choose(key(4)) == "a"


def _batch_play(bandit: BudgetBandit, rates: dict[str, float], steps: int, seed: int) -> list[str]:
    """Steps of a many-row batch: each averages its rows' tokens, so its rate spreads by about 10%."""
    rng = random.Random(seed)
    chosen = []
    for _ in range(steps):
        arm = bandit.choose(ONE_ROW)
        bandit.record(ONE_ROW, arm, 3 * rng.uniform(0.9, 1.1), 3 / rates[arm] * rng.uniform(0.95, 1.05))
        chosen.append(arm)
    return chosen


def test_where_one_step_outweighs_the_prior_each_arm_decides_one_and_a_contradicted_prior_gives_way():
    """Verifying more grew dearer since the profile: it ranks the smaller tree c last; the batch, first."""
    stale, run = {"a": 1.0, "b": 0.9, "c": 0.75}, {"a": 0.8, "b": 0.7, "c": 1.0}
    for seed in range(5):
        bandit = BudgetBandit(("a", "b", "c"), priors={ONE_ROW: stale})
        chosen = _batch_play(bandit, run, 40, seed)
        assert chosen[:2] == ["a", "a"] and set(chosen[2:5]) == {"b", "c"}, "the best; once its spread is known, the rest"
        assert chosen[10:].count("c") >= 27, (seed, chosen)
        assert _weight(bandit) < 1
    for seed in range(5):  # one row's steps spread by about 50%: the prior weighs about 4 of them, none is forced
        bandit = BudgetBandit(("a", "b", "c"), priors={ONE_ROW: RATES})
        assert _play(bandit, RATES, 100, seed).count("c") <= 3 and 2 < _weight(bandit) < 8


def _weight(bandit: BudgetBandit) -> float:
    """The prior's weight in steps, as `choose` computes it."""
    windows = bandit.windows(ONE_ROW).values()
    return (bandit._pooled([(w.own.ratio_spread(), w.plays) for w in windows]) / bandit.prior_error) ** 2


def test_arms_in_flight_count_as_tried_so_that_a_caller_recording_late_tries_none_twice_over():
    """`BoundedController` records a step once the next one has begun: two decisions are in flight."""
    bandit = BudgetBandit(("a", "b", "c"), min_plays=1)
    assert bandit.choose(ONE_ROW) == "a"
    assert bandit.choose(ONE_ROW, in_flight=("a",)) == "b" and bandit.choose(ONE_ROW, in_flight=("b", "a")) == "c"
    assert bandit.choose(ONE_ROW, in_flight=("a", "b", "c")) == "a", "all in flight: nothing else to choose"
    batch = BudgetBandit(("a", "b", "c"), priors={ONE_ROW: {"a": 1.0, "b": 0.9, "c": 0.8}})
    for _ in range(3):  # a's spread is known: a batch's step outweighs the prior, so each arm is tried
        batch.record(ONE_ROW, "a", 3.0 * (1 + 0.05 * _), 3.0)
    assert batch.choose(ONE_ROW) == "b" and batch.choose(ONE_ROW, in_flight=("b",)) == "c"


# the profile's arms as offloaded on the embedded pair: tokens a step, and the profile's rates relative
# to plain decoding, where the run finds them tilted against the larger trees (a slope of -0.25)
TOKENS = {"plain": 1.0, "s1": 1.9, "s4": 3.0}
PROFILED = {"plain": 1.0, "s1": 1.23, "s4": 1.15}
RUN = {arm: PROFILED[arm] * TOKENS[arm] ** -0.25 for arm in TOKENS}  # s1 about 1.05, s4 about 0.87


def _told(bandit: BudgetBandit, arms: tuple[str, ...], rounds: int) -> None:
    """`rounds` steps of each of `arms` at the run's rates, their tokens and ms spread by 10%."""
    for step in range(rounds):
        wobble = 1 + 0.1 * (step % 3 - 1)
        for arm in arms:
            bandit.record(ONE_ROW, arm, TOKENS[arm] * wobble, TOKENS[arm] / RUN[arm] / wobble)


def test_the_prior_tilts_with_the_arms_tokens_a_step_where_the_profile_kept_them():
    tilted = BudgetBandit(tuple(TOKENS), priors={ONE_ROW: PROFILED}, prior_tokens={ONE_ROW: TOKENS})
    flat = BudgetBandit(tuple(TOKENS), priors={ONE_ROW: PROFILED})
    assert tilted.scaled_prior(ONE_ROW) == pytest.approx(PROFILED), "nothing played: the profile's rates as they are"
    for bandit in (tilted, flat):
        _told(bandit, ("plain", "s1"), 6)
    # one scale prices the unplayed four-node tree above plain decoding; the tilt, below, near the run's
    assert flat.scaled_prior(ONE_ROW)["s4"] > RUN["plain"]
    assert tilted.scaled_prior(ONE_ROW)["s4"] < RUN["plain"]
    assert abs(tilted.scaled_prior(ONE_ROW)["s4"] / RUN["s4"] - 1) < abs(flat.scaled_prior(ONE_ROW)["s4"] / RUN["s4"] - 1)
    # no tilt in the run: none in the prior, whatever the arms' tokens
    level = BudgetBandit(tuple(TOKENS), priors={ONE_ROW: PROFILED}, prior_tokens={ONE_ROW: TOKENS})
    for step in range(6):
        for arm in ("plain", "s1"):
            level.record(ONE_ROW, arm, TOKENS[arm] * (1 + 0.1 * (step % 3 - 1)), TOKENS[arm] / (0.5 * PROFILED[arm]))
    assert level.scaled_prior(ONE_ROW)["s4"] == pytest.approx(0.5 * PROFILED["s4"], rel=0.02)


def _tilted_runs(slope: float, tilt: bool, steps: int = 200, seeds: int = 10) -> tuple[float, dict[str, int]]:
    """Mean regret (the share of the best arm's rate lost a step) and plays per arm over `seeds`
    runs of four arms whose run rates are the profile's times tokens ** slope."""
    tokens = {**TOKENS, "s2": 2.3}
    profiled = {**PROFILED, "s2": 1.21}
    run = {arm: profiled[arm] * tokens[arm] ** slope for arm in tokens}
    regret, plays = 0.0, dict.fromkeys(tokens, 0)
    for seed in range(seeds):
        bandit = BudgetBandit(tuple(tokens), priors={ONE_ROW: profiled}, prior_tokens={ONE_ROW: tokens} if tilt else None)
        chosen = _play(bandit, run, steps, seed)
        regret += sum(1 - run[arm] / max(run.values()) for arm in chosen) / steps / seeds
        for arm in chosen:
            plays[arm] += 1
    return regret, plays


def test_a_tilted_run_plays_the_trees_its_profile_overrated_less_and_a_level_one_loses_little():
    (tilted, tilted_plays), (flat, flat_plays) = (_tilted_runs(-0.25, tilt) for tilt in (True, False))
    assert tilted_plays["s4"] < 0.7 * flat_plays["s4"] and tilted < flat, (tilted_plays, flat_plays)
    (tilted, tilted_plays), (flat, flat_plays) = (_tilted_runs(-0.4, tilt) for tilt in (True, False))
    assert tilted_plays["plain"] > 2 * flat_plays["plain"] and tilted < 0.85 * flat, "plain, best here, is found sooner"
    tilted, flat = (_tilted_runs(0.0, tilt)[0] for tilt in (True, False))
    assert tilted < 1.15 * flat, "where the run keeps the profile's ratios, fitting a tilt costs little"


def test_the_tilt_needs_every_prior_arms_tokens_and_a_non_negative_spread():
    partial = BudgetBandit(tuple(TOKENS), priors={ONE_ROW: PROFILED}, prior_tokens={ONE_ROW: {"plain": 1.0, "s1": 1.9}})
    _told(partial, ("plain", "s1"), 6)
    flat = BudgetBandit(tuple(TOKENS), priors={ONE_ROW: PROFILED})
    _told(flat, ("plain", "s1"), 6)
    assert partial.scaled_prior(ONE_ROW) == pytest.approx(flat.scaled_prior(ONE_ROW)), "an arm without tokens: one scale"
    with pytest.raises(ValueError, match="tilt_spread"):
        BudgetBandit(("a",), tilt_spread=-1.0)


def test_an_arm_adjusted_to_no_tokens_tells_no_tilt():
    bandit = BudgetBandit(tuple(TOKENS), priors={ONE_ROW: PROFILED}, prior_tokens={ONE_ROW: TOKENS})
    _told(bandit, ("plain", "s1"), 6)
    rates = {"plain": RUN["plain"], "s1": 0.0}  # what `rate_at` gives an arm whose adjusted tokens fell to none
    scales = bandit._tilted_scales(rates, bandit.windows(ONE_ROW), PROFILED, TOKENS, 0.3)
    assert scales == pytest.approx(dict.fromkeys(TOKENS, RUN["plain"] / PROFILED["plain"]))
