"""The bandit's difficulty adjustment: an arm judged on the requests it happened to decide is judged
at the regime's difficulty instead (its tokens regressed on the steps' references), plain
decoding's constant tokens are left as they are, and too few referenced steps adjust nothing."""

import pytest

from moe_spec.policy.arm_windows import MIN_PAIRS
from moe_spec.policy.budget_bandit import BudgetBandit

from tests.policy.test_bounded_controller import ONE_ROW


def _hard_then_easy(adjust: bool) -> BudgetBandit:
    """Arm a decides 10 steps of a hard request, then b 10 of an easy one. Both make 2 x reference
    tokens; a's steps cost 10 ms, b's 11."""
    bandit = BudgetBandit(("a", "b"), adjust=adjust)
    for step in range(10):
        reference = 1.0 + 0.1 * (step % 3)  # hard: the best node alone is seldom accepted
        bandit.record(ONE_ROW, "a", 2 * reference, 10.0, reference=reference)
    for step in range(10):
        reference = 1.8 + 0.1 * (step % 3)  # easy
        bandit.record(ONE_ROW, "b", 2 * reference, 11.0, reference=reference)
    return bandit


def test_arms_judged_on_different_requests_are_compared_at_the_same_difficulty():
    unadjusted = _hard_then_easy(adjust=False).rates(ONE_ROW)
    assert unadjusted["b"] > unadjusted["a"], "unadjusted, the arm that decided the easy request looks best"
    bandit = _hard_then_easy(adjust=True)
    adjusted = bandit.rates(ONE_ROW)
    assert adjusted["a"] > adjusted["b"]
    reference = bandit.reference(ONE_ROW)
    assert reference == pytest.approx((10 * 1.0 + 10 * 1.8 + 2 * (3 * 0.1 + 3 * 0.2)) / 20)
    assert adjusted["a"] == pytest.approx(2 * reference / 10.0)
    assert adjusted["b"] == pytest.approx(2 * reference / 11.0)


def test_constant_tokens_are_not_adjusted_and_few_referenced_steps_adjust_nothing():
    bandit = BudgetBandit(("plain", "tree"))
    for step in range(12):
        reference = 1.0 + (step % 2)
        bandit.record(ONE_ROW, "tree", 1.0 + 2 * (reference - 1), 12.0, credits={"plain": 1.0}, reference=reference)
    for _ in range(MIN_PAIRS - 1):
        bandit.record(ONE_ROW, "plain", 1.0, 8.0)  # plain steps tell no reference
    windows = bandit.windows(ONE_ROW)
    assert windows["plain"].tokens_at(bandit.reference(ONE_ROW)) == pytest.approx(1.0)
    assert windows["plain"].reference_slope() is None, "tokens that do not vary are not adjusted"
    assert windows["tree"].reference_slope() == pytest.approx(2.0)

    few = BudgetBandit(("a",))
    for step in range(MIN_PAIRS - 1):
        few.record(ONE_ROW, "a", 3.0 + step, 10.0, reference=1.0 + step)
    assert few.windows(ONE_ROW)["a"].tokens_at(5.0) == pytest.approx(few.windows(ONE_ROW)["a"].tokens_window.mean)


def test_a_reference_told_to_a_bandit_that_does_not_adjust_is_ignored():
    bandit = BudgetBandit(("a",), adjust=False)
    bandit.record(ONE_ROW, "a", 2.0, 10.0, reference=1.5)
    assert bandit.reference(ONE_ROW) is None and not len(bandit.windows(ONE_ROW)["a"].referenced)


def test_the_unadjusted_ablation_is_the_same_bound_with_a_bandit_that_ignores_references():
    from moe_spec.policy.bounded_controller import BoundedController
    from moe_spec.policy.registry import build_controller

    from tests.policy.test_controllers import _profiled

    _, _, profile = _profiled("qwen3_moe")
    adjusted, unadjusted = (build_controller(name, lambda: profile) for name in ("moe-aware", "moe-aware-unadjusted"))
    assert isinstance(adjusted, BoundedController) and isinstance(unadjusted, BoundedController)
    assert adjusted.bandit.adjust and not unadjusted.bandit.adjust
    assert adjusted.bandit.arms == unadjusted.bandit.arms
