"""`moe-aware`'s bound over fixed budgets: the bandit keeps to the best measured arm with few
plays of the others, each arm decodes exactly as its own method does, and the whole stays lossless."""

import random

import pytest
import torch

from moe_spec import LookupDrafter, SpecDecoder
from moe_spec.core.drafting import EAGLE2_BUDGET
from moe_spec.core.sampling import GREEDY, SamplingConfig
from moe_spec.core.step_record import DecodeObserver, StepRecord
from moe_spec.policy.bounded_controller import PLAIN, SIZED, BoundedController
from moe_spec.policy.budget_bandit import BudgetBandit, RegimeKey
from moe_spec.policy.moe_aware import MoeAwareController
from moe_spec.policy.registry import build_controller
from moe_spec.policy.static import StaticController
from moe_spec.testing.helpers import PLAIN_PROMPT, REPETITIVE_PROMPT, hf_greedy

from tests.policy.test_controllers import CountingLookupDrafter, _profiled

ONE_ROW = RegimeKey.of(GREEDY, 1)


def _play(bandit: BudgetBandit, rates: dict[str, float], steps: int, seed: int = 0, key=ONE_ROW) -> list[str]:
    """`steps` steps of arms whose steps make 1-5 tokens (uniform, as accepted lengths swing) in a
    time that does not depend on them, `rates[arm]` tokens per ms on average."""
    rng = random.Random(seed)
    chosen = []
    for _ in range(steps):
        arm = bandit.choose(key)
        tokens = rng.randint(1, 5)
        bandit.record(key, arm, tokens, 3 / rates[arm] * rng.uniform(0.8, 1.2))
        chosen.append(arm)
    return chosen


def test_the_bandit_tries_each_arm_in_order_then_keeps_to_the_best():
    rates = {"a": 0.7, "b": 1.0, "c": 0.5}
    late_best, regret = [], []
    for seed in range(10):
        bandit = BudgetBandit(("a", "b", "c"))
        chosen = _play(bandit, rates, 600, seed)
        assert chosen[:9] == ["a"] * 3 + ["b"] * 3 + ["c"] * 3
        late_best.append(chosen[300:].count("b") / 300)
        regret.append(sum(1 - rates[arm] for arm in chosen) / 600)
    assert min(late_best) > 0.8 and sum(regret) / 10 < 0.04, (late_best, regret)


def test_the_bandits_plays_of_a_worse_arm_stay_few_and_grow_only_with_forgotten_evidence():
    for horizon, most in ((None, 0.05), (128, 0.08)):
        first = second = 0
        for seed in range(5):
            chosen = _play(BudgetBandit(("best", "worse"), horizon=horizon), {"best": 1.0, "worse": 0.75}, 2000, seed)
            first, second = first + chosen[:1000].count("worse"), second + chosen[1000:].count("worse")
        assert first < most * 5000 and second < most * 5000, (horizon, first, second)
        if horizon is None:
            assert second < first, "kept evidence: the worse arm's plays grow like the log of the steps"


def test_an_arm_judged_on_unlucky_steps_is_judged_again_once_they_are_forgotten():
    """Its first steps made 1 token each (a prompt that accepted nothing); it is the better arm."""
    shares = {}
    for horizon in (None, 128):
        late = 0
        for seed in range(5):
            bandit = BudgetBandit(("good", "other"), horizon=horizon)
            for _ in range(3):
                bandit.record(ONE_ROW, "good", 1.0, 3.0)
            late += _play(bandit, {"good": 1.0, "other": 0.8}, 1000, seed)[500:].count("good")
        shares[horizon] = late / 2500
    assert shares[128] > 0.7 and shares[128] > shares[None] + 0.5, shares


def test_regimes_are_measured_apart_and_a_new_regime_starts_by_trying_every_arm():
    bandit = BudgetBandit(("a", "b"))
    _play(bandit, {"a": 1.0, "b": 0.5}, 100)
    sampled = RegimeKey.of(SamplingConfig(temperature=1.0), 1)
    assert sampled != ONE_ROW and RegimeKey.of(GREEDY, 3) == RegimeKey.of(GREEDY, 4) != ONE_ROW
    assert bandit.choose(sampled) == "a" and bandit.rates(sampled) == {}
    for _ in range(bandit.min_plays):
        bandit.record(sampled, "a", 1, 10.0)
    assert bandit.choose(sampled) == "b"


def test_the_sizings_own_gate_must_be_off_and_arms_must_be_known():
    _, _, profile = _profiled("qwen3_moe")
    with pytest.raises(ValueError, match="gate"):
        BoundedController(MoeAwareController(profile))
    with pytest.raises(ValueError, match="static:5"):
        BoundedController(MoeAwareController(profile, gate=False), bandit=BudgetBandit(("static:5",)))


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_a_fixed_arm_decodes_exactly_as_its_static_method(arch):
    model, target, profile = _profiled(arch)
    sizing = MoeAwareController(profile, gate=False)
    bounded = BoundedController(sizing, fixed=(2,), bandit=BudgetBandit(("static:2",)))
    static = StaticController(EAGLE2_BUDGET.with_nodes(2))
    prompt = torch.tensor([REPETITIVE_PROMPT])
    ours = SpecDecoder(target, drafter=LookupDrafter(), controller=bounded).generate(prompt, max_new_tokens=20)
    theirs = SpecDecoder(target, drafter=LookupDrafter(), controller=static).generate(prompt, max_new_tokens=20)
    assert torch.equal(ours.sequences, theirs.sequences)
    assert torch.equal(ours.sequences, hf_greedy(model, REPETITIVE_PROMPT, 20))
    assert [s.tree_size for s in ours.stats.steps] == [s.tree_size for s in theirs.stats.steps]
    assert bounded.decisions["static:2"] == len(ours.stats.steps)


def test_the_plain_arm_drafts_nothing():
    model, target, profile = _profiled("qwen3_moe")
    bounded = BoundedController(MoeAwareController(profile, gate=False), bandit=BudgetBandit((PLAIN,)))
    drafter = CountingLookupDrafter()
    result = SpecDecoder(target, drafter=drafter, controller=bounded).generate(torch.tensor([PLAIN_PROMPT]),
                                                                               max_new_tokens=12)
    assert torch.equal(result.sequences, hf_greedy(model, PLAIN_PROMPT, 12))
    assert drafter.proposals == 0 and all(step.tree_size == 0 for step in result.stats.steps)


def test_moe_aware_is_bounded_in_a_real_run_and_learns_across_requests():
    model, target, profile = _profiled("qwen3_moe")
    controller = build_controller("moe-aware", lambda: profile)
    assert isinstance(controller, BoundedController) and controller.bandit.arms[0] == SIZED
    replayed = build_controller("moe-aware", lambda: profile, adapt=False)
    assert isinstance(replayed, MoeAwareController) and replayed.settings.gate, "a replay measures no throughput to choose by"
    assert isinstance(build_controller("moe-aware-unbounded", lambda: profile), MoeAwareController)
    decoder = SpecDecoder(target, drafter=LookupDrafter(), controller=controller)
    steps = 0
    for prompt in (REPETITIVE_PROMPT, PLAIN_PROMPT, REPETITIVE_PROMPT):
        result = decoder.generate(torch.tensor([prompt]), max_new_tokens=16)
        assert torch.equal(result.sequences, hf_greedy(model, prompt, 16))
        steps += len(result.stats.steps)
    assert sum(controller.decisions.values()) == steps
    windows = controller.bandit.windows(ONE_ROW).values()
    judged = steps - 3 * controller.settle_steps  # each request's first steps are not judged
    # the last request's last step is recorded when the next request begins: until then its cost is open
    assert sum(window.plays for window in windows) == judged - 1, "every request's steps are kept for the next"
    references = controller.bandit._references[ONE_ROW].values
    assert references and set(references) <= {1.0, 2.0}, "greedy: the best node alone is accepted or not"


class _Starts(DecodeObserver):
    def __init__(self):
        self.steps: list[StepRecord] = []

    def on_step(self, record: StepRecord) -> None:
        self.steps.append(record)


def test_each_judged_step_is_charged_from_its_start_to_the_next_steps_start():
    _, target, profile = _profiled("qwen3_moe")
    bandit = BudgetBandit(("static:2",))
    controller = BoundedController(MoeAwareController(profile, gate=False), bandit=bandit)
    starts = _Starts()
    decoder = SpecDecoder(target, drafter=LookupDrafter(), controller=controller, observer=starts)
    decoder.generate(torch.tensor([REPETITIVE_PROMPT]), max_new_tokens=16)
    judged = starts.steps[controller.settle_steps:]
    charged = [ms for _, ms in bandit.windows(ONE_ROW)["static:2"].own.steps]
    gaps = [(after.started - step.started) * 1000 for step, after in zip(judged, judged[1:])]
    assert len(judged) > 3 and charged == pytest.approx(gaps, rel=1e-9)
    assert all(gap > step.step_ms for gap, step in zip(gaps, judged)), "observe and the loop's bookkeeping are charged"
    decoder.generate(torch.tensor([PLAIN_PROMPT]), max_new_tokens=16)  # begins by recording the last step
    last, charged_last = judged[-1], bandit.windows(ONE_ROW)["static:2"].own.steps[len(gaps)][1]
    assert last.step_ms < charged_last < (starts.steps[len(judged) + controller.settle_steps].started - last.started) * 1000, \
        "no step followed it: its own time and its observe, not the next request's prefill"


def _nested_play(credit: bool, seed: int, steps: int = 400) -> tuple[float, float]:
    """Fixed budgets of 1, 2, 4, 6 nodes on the same steps: a step's accepted length L (0-6, the
    same for every budget) gives budget k min(L, k) + 1 tokens in a time growing with k; with
    `credit`, a budget's step tells every smaller budget's tokens, as a greedy step does. Returns
    the tokens per ms summed over the steps, the bandit's and the best constant budget's."""
    rng = random.Random(seed)
    cost = {"k1": 10.0, "k2": 11.0, "k4": 13.5, "k6": 16.5}
    nodes = {"k1": 1, "k2": 2, "k4": 4, "k6": 6}
    bandit = BudgetBandit(tuple(cost))
    made = 0.0
    constant = dict.fromkeys(cost, 0.0)
    for _ in range(steps):
        accepted = min(int(rng.expovariate(0.45)), 6)
        arm = bandit.choose(ONE_ROW)
        tokens = {name: min(accepted, k) + 1 for name, k in nodes.items()}
        credits = {name: tokens[name] for name in nodes if nodes[name] < nodes[arm]} if credit else None
        bandit.record(ONE_ROW, arm, tokens[arm], cost[arm] * rng.uniform(0.95, 1.05), credits=credits)
        made += tokens[arm] / cost[arm]
        for name in nodes:
            constant[name] += tokens[name] / cost[name]
    return made, max(constant.values())


def test_credits_from_larger_budgets_cut_the_cost_of_exploring_the_smaller_ones():
    (with_credit, best), (without, _) = ([sum(x) for x in zip(*(_nested_play(credit, seed) for seed in range(20)))]
                                         for credit in (True, False))
    regret, regret_alone = 1 - with_credit / best, 1 - without / best
    assert regret < 0.02 and regret < 0.7 * regret_alone, (regret, regret_alone)


def test_credited_tokens_enter_the_rate_without_counting_as_plays():
    bandit = BudgetBandit(("big", "small"))
    for _ in range(3):
        bandit.record(ONE_ROW, "big", 4.0, 10.0, credits={"small": 2.0, "unknown": 9.0})
    bandit.record(ONE_ROW, "small", 2.0, 5.0)
    windows = bandit.windows(ONE_ROW)
    assert windows["small"].plays == 1 and len(windows["small"].tokens_window) == 4
    assert windows["small"].rate_at(None) == pytest.approx(2.0 / 5.0) and windows["big"].rate_at(None) == pytest.approx(0.4)


def _sampled_sizing(target, profile) -> MoeAwareController:
    from moe_spec.policy.candidate_scheme import CandidateScheme

    return MoeAwareController(profile, gate=False, scheme=CandidateScheme.SAMPLED)


def test_with_sampled_candidates_the_fixed_arms_are_chains_decoding_as_their_method():
    from moe_spec.core.drafting import TreeBudget
    from moe_spec.drafters.eagle import EagleDrafter
    from moe_spec.policy.candidate_scheme import CandidateScheme
    from moe_spec.testing.helpers import random_eagle_head

    _, target, profile = _profiled("qwen3_moe")
    head = random_eagle_head(target)
    bounded = BoundedController(_sampled_sizing(target, profile), fixed=(3,), bandit=BudgetBandit(("chain:3",)))
    chain = StaticController(TreeBudget(3, 3, 1), CandidateScheme.SAMPLED)
    runs = []
    for controller in (bounded, chain):
        decoder = SpecDecoder(target, drafter=EagleDrafter(head, target), controller=controller)
        runs.append(decoder.generate(torch.tensor([PLAIN_PROMPT]), max_new_tokens=16, temperature=1.0,
                                     generator=torch.Generator().manual_seed(3)))
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    assert [s.tree_size for s in runs[0].stats.steps] == [s.tree_size for s in runs[1].stats.steps]
    assert max(s.tree_size for s in runs[0].stats.steps) == 3
    with pytest.raises(ValueError, match="allowed"):  # a bandit of trees alone has no arm for sampled candidates
        BoundedController(_sampled_sizing(target, profile), fixed=(3,), bandit=BudgetBandit(("static:3",))).begin(
            EAGLE2_BUDGET, SamplingConfig(1.0))


def test_sampled_steps_credit_the_shorter_chains_with_their_expected_tokens():
    from moe_spec.drafters.eagle import EagleDrafter
    from moe_spec.testing.helpers import random_eagle_head

    _, target, profile = _profiled("qwen3_moe")
    controller = BoundedController(_sampled_sizing(target, profile))
    decoder = SpecDecoder(target, drafter=EagleDrafter(random_eagle_head(target), target), controller=controller)
    for seed in range(3):
        decoder.generate(torch.tensor([PLAIN_PROMPT]), max_new_tokens=24, temperature=1.0,
                         generator=torch.Generator().manual_seed(seed))
    assert set(controller.decisions) <= {SIZED, PLAIN, "chain:1", "chain:2", "chain:3", "chain:4", "chain:6"}
    windows = controller.bandit.windows(RegimeKey.of(SamplingConfig(1.0), 1))
    chain1 = windows["chain:1"]
    assert len(chain1.tokens_window) > chain1.plays, "longer chains' steps told chain:1's tokens"
    assert all(1.0 <= tokens <= 2.0 for tokens in chain1.tokens_window.values)
    assert any(tokens != round(tokens) for tokens in chain1.tokens_window.values), "expected, not drawn, tokens"
    references = controller.bandit._references[RegimeKey.of(SamplingConfig(1.0), 1)].values
    assert references and all(1.0 <= r <= 2.0 for r in references), "1 + P(the first draw is accepted)"
    # every step that tells its tokens drafted, and so has a reference, but a request's last, which
    # drafts nothing (one token left) and may fall to chain:1 itself: at most one a request
    assert 0 <= len(chain1.tokens_window) - len(chain1.referenced) <= 3, "a step that drafted carries a reference"


def test_bounded_moe_aware_keeps_the_target_distribution_with_sampled_chains():
    from moe_spec.core.target import TargetModel
    from moe_spec.drafters.eagle import EagleDrafter
    from moe_spec.drafters.eagle_config import config_for_target
    from moe_spec.drafters.eagle_head import EagleHead
    from moe_spec.measure.profiler import build_profile
    from moe_spec.testing.helpers import assert_follows, exact_distribution_of_tokens_2_and_3
    from moe_spec.testing.tiny_models import tiny_model

    from tests.policy.test_controllers import QUICK

    vocab, prompt = 6, [1, 4, 2, 5]
    model = tiny_model("qwen3_moe", vocab_size=vocab, seed=4)
    target = TargetModel(model)
    profile = build_profile(target, LookupDrafter(), [torch.tensor(prompt * 4), torch.tensor(prompt[::-1] * 4)], QUICK)
    torch.manual_seed(0)
    head = EagleHead(config_for_target(target, draft_vocab_size=vocab), torch.randperm(vocab)).eval()
    # without plain decoding among the arms: it wins by measured time on a target this small, which
    # would leave the chains (what this test checks) to few steps, more or fewer with the machine's load
    arms = (SIZED, "chain:4", "chain:2", "chain:1", "chain:3")
    controller = BoundedController(_sampled_sizing(target, profile), fixed=(4, 2, 1, 3), bandit=BudgetBandit(arms))
    controller.settle_steps = 0  # requests of one or two steps: judge them all, so every arm decides
    decoder = SpecDecoder(target, drafter=EagleDrafter(head, target), controller=controller)
    generator = torch.Generator().manual_seed(11)
    counts = torch.zeros(vocab, vocab)
    for _ in range(1500):
        result = decoder.generate(torch.tensor([prompt]), max_new_tokens=4, temperature=1.0, eos_token_id=[],
                                  generator=generator)
        _x1, x2, x3, _x4 = result.sequences[0, len(prompt):].tolist()
        counts[x2, x3] += 1
    assert sum(n for arm, n in controller.decisions.items() if arm.startswith("chain:")) > 100, controller.decisions
    assert_follows(counts, exact_distribution_of_tokens_2_and_3(model, prompt, vocab, SamplingConfig(1.0)))
