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
