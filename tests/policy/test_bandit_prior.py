"""The bandit's measured prior: arms the profile measured are not played to be judged, the far worse
ones stay nearly unplayed, the prior's level is the run's (its ratios carry over, not its speed),
and a prior the run contradicts gives way to what the run measures."""

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


def test_prior_steps_must_be_positive():
    with pytest.raises(ValueError, match="prior_steps"):
        BudgetBandit(("a",), prior_steps=0)


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
