"""Arms judged at the request's difficulty (`moe-aware-request`): the request's mean reference,
shrunk towards the run's; a bandit told it judges a deep tree lower on a hard request and leaves
plain decoding where it was; the bounded controller tells it from each request's own steps."""

import pytest
import torch

from moe_spec import LookupDrafter, SpecDecoder
from moe_spec.core.step_record import DecodeObserver, StepRecord
from moe_spec.policy.arm_windows import RequestDifficulty
from moe_spec.policy.bounded_controller import BoundedController
from moe_spec.policy.budget_bandit import BudgetBandit
from moe_spec.policy.registry import REQUEST_PRIOR_STEPS, build_controller

from moe_spec.testing.helpers import PLAIN_PROMPT, REPETITIVE_PROMPT

from tests.policy.test_bounded_controller import ONE_ROW
from tests.policy.test_controllers import _profiled


def test_a_requests_difficulty_is_its_mean_reference_shrunk_towards_the_runs():
    difficulty = RequestDifficulty(4)
    assert difficulty.at(None) is None, "without the run's difficulty there is nothing to shrink towards"
    assert difficulty.at(1.6) == pytest.approx(1.6), "a request that told nothing yet is the run's"
    for reference in (1.0, 1.0, 2.0, 1.0):
        difficulty.add(reference)
    assert difficulty.at(1.6) == pytest.approx((5.0 + 4 * 1.6) / 8)
    difficulty.reset()
    assert difficulty.at(1.2) == pytest.approx(1.2)
    with pytest.raises(ValueError, match="prior_steps"):
        RequestDifficulty(0)


def _deep_beside_plain() -> BudgetBandit:
    """`deep` makes 1 + 2 (reference - 1) tokens in 12 ms; `plain` one token in 8 ms: at the run's
    difficulty (reference 1.5: 2 tokens) deep is best, on a request whose best node alone is never
    accepted (reference 1: 1 token) plain is."""
    bandit = BudgetBandit(("deep", "plain"), exploration=0.0)
    for step in range(16):
        reference = 1.0 + (step % 2)
        bandit.record(ONE_ROW, "deep", 1.0 + 2 * (reference - 1), 12.0, credits={"plain": 1.0}, reference=reference)
        bandit.record(ONE_ROW, "plain", 1.0, 8.0)
    return bandit


def test_a_bandit_told_the_requests_difficulty_judges_a_deep_tree_there():
    bandit = _deep_beside_plain()
    assert bandit.choose(ONE_ROW) == "deep", "at the run's difficulty the deep tree is best"
    hard = RequestDifficulty(1)
    for _ in range(15):
        hard.add(1.0)
    assert hard.at(bandit.reference(ONE_ROW)) == pytest.approx((15 + 1.5) / 16)
    assert bandit.choose(ONE_ROW, difficulty=hard) == "plain"
    easy = RequestDifficulty(1)
    for _ in range(15):
        easy.add(2.0)
    assert bandit.choose(ONE_ROW, difficulty=easy) == "deep"
    plain_rate = bandit.windows(ONE_ROW)["plain"].rate_at(hard.at(bandit.reference(ONE_ROW)))
    assert plain_rate == pytest.approx(1.0 / 8.0), "plain decoding's one token does not move with difficulty"


class _Drafted(DecodeObserver):
    def __init__(self):
        self.steps = 0  # steps that verified a drafted node (each tells a reference)

    def on_step(self, record: StepRecord) -> None:
        self.steps += record.verified.num_drafted > 0


def test_the_request_ablation_tells_each_requests_difficulty_and_starts_afresh_per_request():
    _, target, profile = _profiled("qwen3_moe")
    controller = build_controller("moe-aware-request", lambda: profile)
    assert isinstance(controller, BoundedController)
    assert controller._difficulty is not None and controller._difficulty.prior_steps == REQUEST_PRIOR_STEPS
    assert build_controller("moe-aware", lambda: profile)._difficulty is None, "the default judges at the run's"
    for prompt in (REPETITIVE_PROMPT, PLAIN_PROMPT):
        drafted = _Drafted()
        SpecDecoder(target, drafter=LookupDrafter(), controller=controller, observer=drafted).generate(
            torch.tensor([prompt]), max_new_tokens=16)
        assert controller._difficulty._count == drafted.steps, "each drafting step of the request, none before it"
