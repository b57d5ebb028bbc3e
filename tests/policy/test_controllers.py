"""Every controller policy stays lossless, and the cost-aware ones decide as their economics say."""

from dataclasses import replace

import pytest
import torch

from moe_spec import LookupDrafter, SpecDecoder, TreeBudget
from moe_spec.core.acceptance import Acceptance
from moe_spec.policy.static import StaticController
from moe_spec.policy.moe_aware import MoeAwareController, _Choice
from moe_spec.policy.truncate import TruncateController, token_count_cost
from moe_spec.policy.online_correction import AcceptanceCorrection
from moe_spec.measure.latency import TimingConfig
from moe_spec.measure.profiler import ProfileSettings, build_profile
from moe_spec.core.target import TargetModel
from moe_spec.testing.tiny_models import tiny_model
from moe_spec.core.forest import StepForest
from moe_spec.core.routing import empty_routing
from moe_spec.core.step_record import StepRecord
from moe_spec.core.tree import DraftTree

from moe_spec.testing.helpers import PLAIN_PROMPT, REPETITIVE_PROMPT, hf_greedy

QUICK = ProfileSettings(
    max_new_tokens=16, prefix_len=16, grid_tokens=(1, 4, 16), grid_experts=(2, 4, 8), natural_trees=6,
    curve_sizes=(1, 2, 4, 8), timing=TimingConfig(repeats=2, warmup=1, evict_mb=0),
)
PROFILE_PROMPTS = [REPETITIVE_PROMPT, PLAIN_PROMPT, REPETITIVE_PROMPT[3:] * 2, [30, 31, 32, 33] * 4]


class CountingLookupDrafter(LookupDrafter):
    """The lookup drafter, counting how often it is asked to draft."""

    proposals = 0

    def propose(self, root_token, budget, sampling):
        self.proposals += 1
        return super().propose(root_token, budget, sampling)


def _profiled(arch: str):
    model = tiny_model(arch)
    target = TargetModel(model)
    profile = build_profile(target, LookupDrafter(), [torch.tensor(p) for p in PROFILE_PROMPTS], QUICK)
    return model, target, profile


@pytest.fixture(scope="module", params=["qwen3_moe", "gpt_oss", "deepseek_v3", "llama"])
def profiled(request):
    return _profiled(request.param)


def _policies(profile):
    return {
        "static:4": StaticController(TreeBudget(4, 8, 4)),
        "truncate": TruncateController(profile, token_count_cost(profile), budget=TreeBudget(16, 8, 4)),
        "moe-aware": MoeAwareController(profile),
        "moe-aware-noexperts": MoeAwareController(profile, price_experts=False),
    }


def test_every_policy_is_lossless_under_greedy(profiled):
    model, target, profile = profiled
    for name, controller in _policies(profile).items():
        decoder = SpecDecoder(target, drafter=LookupDrafter(), controller=controller)
        for prompt in (REPETITIVE_PROMPT, PLAIN_PROMPT):
            result = decoder.generate(torch.tensor([prompt]), max_new_tokens=20)
            assert torch.equal(result.sequences, hf_greedy(model, prompt, 20)), name


def test_policies_return_connected_subtrees_with_the_root(profiled):
    _, _, profile = profiled
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        n = int(torch.randint(1, 25, (1,), generator=generator))
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=generator)) for i in range(1, n)]
        scores = torch.zeros(n)
        for i in range(1, n):
            scores[i] = scores[parents[i]] - float(torch.rand((), generator=generator)) * 2
        tree = DraftTree(torch.randint(0, 90, (n,), generator=generator), torch.tensor(parents), scores)
        for name, controller in _policies(profile).items():
            (chosen,) = controller.plan(StepForest((tree,)), draft_ms=1.0).verify
            assert int(chosen.tokens[0]) == int(tree.tokens[0]), name
            assert len(chosen) <= len(tree)


def test_no_speculation_when_the_cost_model_says_it_cannot_pay():
    model, target, profile = _profiled("qwen3_moe")
    costly_tokens = replace(profile, cost_model=replace(profile.cost_model, per_token_ms=1e3))
    controller = MoeAwareController(costly_tokens, adapt=False)
    drafter = CountingLookupDrafter()
    decoder = SpecDecoder(target, drafter=drafter, controller=controller)
    result = decoder.generate(torch.tensor([REPETITIVE_PROMPT]), max_new_tokens=24)
    assert torch.equal(result.sequences, hf_greedy(model, REPETITIVE_PROMPT, 24))
    assert all(step.tree_size == 0 for step in result.stats.steps)
    assert drafter.proposals < len(result.stats.steps) // 2, "drafting pauses once speculation stops paying"


def test_speculation_is_chosen_when_tokens_are_nearly_free():
    model, target, profile = _profiled("qwen3_moe")
    cheap = replace(profile, cost_model=replace(profile.cost_model, base_ms=10.0, per_token_ms=1e-3,
                                                per_expert_ms=(1e-4,)))
    decoder = SpecDecoder(target, drafter=LookupDrafter(), controller=MoeAwareController(cheap, adapt=False))
    result = decoder.generate(torch.tensor([REPETITIVE_PROMPT * 2]), max_new_tokens=24)
    assert result.stats.mean_tree_size > 1


def test_online_corrections_reset_per_generate_unless_persisted():
    _, target, profile = _profiled("mixtral")
    for persist in (False, True):
        controller = MoeAwareController(profile, persist=persist)
        decoder = SpecDecoder(target, drafter=LookupDrafter(), controller=controller)
        decoder.generate(torch.tensor([REPETITIVE_PROMPT]), max_new_tokens=16)
        learned = dict(controller.acceptance_correction.predicted)
        decoder.generate(torch.tensor([PLAIN_PROMPT]), max_new_tokens=2)
        if persist:
            assert controller.acceptance_correction.predicted == learned
        else:
            assert controller.acceptance_correction.predicted == {} or controller.acceptance_correction.predicted != learned


def _forest(rows: int, nodes: int, seed: int) -> list[DraftTree]:
    generator = torch.Generator().manual_seed(seed)
    trees = []
    for _ in range(rows):
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=generator)) for i in range(1, nodes)]
        scores = torch.zeros(nodes)
        for i in range(1, nodes):
            scores[i] = scores[parents[i]] - float(torch.rand((), generator=generator))
        trees.append(DraftTree(torch.randint(0, 90, (nodes,), generator=generator), torch.tensor(parents), scores))
    return trees


def test_batched_predictions_and_corrections_carry_the_row_term():
    _, _, measured = _profiled("qwen3_moe")
    profile = replace(measured, cost_model=replace(measured.cost_model, per_row_ms=0.0))
    with_rows = replace(profile, cost_model=replace(profile.cost_model, per_row_ms=5.0))
    trees = _forest(3, 6, seed=0)
    plain, rowed = MoeAwareController(profile), MoeAwareController(with_rows)
    assert rowed.predicted_verify_ms(trees) - plain.predicted_verify_ms(trees) == pytest.approx(2 * 5.0)
    assert rowed.predicted_verify_ms(trees[:1]) == pytest.approx(plain.predicted_verify_ms(trees[:1]))
    rowed.cost_correction.update(1.0, 1.5)  # measured 1.5x the prediction: the machine runs slower
    scale = rowed.cost_correction.scale
    assert 1.0 < scale < 1.5, "one pass moves the scale part of the way"
    corrected = rowed.cost_model()
    assert corrected.per_row_ms == pytest.approx(5.0 * scale), "every term scales with the machine's speed"
    assert corrected.per_token_ms == pytest.approx(with_rows.cost_model.per_token_ms * scale)
    assert corrected.base_ms == pytest.approx(with_rows.cost_model.base_ms * scale)
    assert corrected.per_expert_ms == pytest.approx(tuple(v * scale for v in with_rows.cost_model.per_expert_ms))


def test_truncate_prices_a_batch_with_the_row_term_and_learns_from_the_whole_pass():
    _, _, measured = _profiled("qwen3_moe")
    # fixed coefficients, not this run's timings: with a cheap measured token every node pays at
    # either row price and the comparison below would say nothing (it did flake that way)
    fixed = replace(measured.cost_model, base_ms=5.0, per_token_ms=0.5, per_expert_ms=(0.05,), per_row_ms=0.0)
    profile = replace(measured, cost_model=fixed)
    token_cost = token_count_cost(profile)
    trees = _forest(4, 12, seed=1)
    kept = []
    for per_row_ms in (0.0, 200.0):
        dear_rows = replace(profile, cost_model=replace(profile.cost_model, per_row_ms=per_row_ms))
        controller = TruncateController(dear_rows, token_count_cost(dear_rows), adapt=False)
        kept.append(sum(t.num_drafted for t in controller.plan(StepForest(trees), draft_ms=1.0).verify))
        assert [t.num_drafted for t in controller.plan(StepForest(trees[:1]), draft_ms=1.0).verify] == [
            t.num_drafted for t in TruncateController(profile, token_cost, adapt=False).plan(StepForest(trees[:1]), draft_ms=1.0).verify
        ], "one row: the row term plays no part"
    assert kept[1] > kept[0], "a dear pass per row makes each row's drafted tokens relatively cheaper"
    # observing prices the whole pass as B rows: a pass measured at that price needs no correction
    dear_rows = replace(profile, cost_model=replace(profile.cost_model, per_row_ms=200.0))
    dear_cost = token_count_cost(dear_rows)
    controller = TruncateController(dear_rows, dear_cost)
    measured = dear_cost(len(trees) * max(len(t) for t in trees), len(trees))  # a padded pass
    controller.observe(_record(trees, [Acceptance([0, 1], 5) for _ in trees], measured, 1.0))
    assert controller.cost_correction.scale == pytest.approx(1.0)
    assert controller.cost_correction.row_ms == pytest.approx(0.0)


def test_values_of_a_batch_equal_each_trees_values(profiled):
    """The batched computation (and one tree's, node by node) against the definition: the calibrated path probability times the
    depth's correction, made non-increasing down each path."""
    _, _, profile = profiled
    controller = MoeAwareController(profile)
    for depth, (predicted, observed) in {1: (0.5, 1.0), 2: (0.5, 0.0), 3: (0.2, 0.0)}.items():
        for _ in range(30):
            controller.acceptance_correction.update(depth, predicted, observed)
    generator = torch.Generator().manual_seed(1)
    trees = []
    for n in (1, 7, 19, 4):
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=generator)) for i in range(1, n)]
        scores = torch.zeros(n)
        for i in range(1, n):
            scores[i] = scores[parents[i]] - float(torch.rand((), generator=generator)) * 2
        trees.append(DraftTree(torch.randint(0, 90, (n,), generator=generator), torch.tensor(parents), scores))
    for tree, batched in zip(trees, controller.values_of(trees)):
        alone = controller.values(tree)  # one row: computed node by node in plain Python
        assert torch.allclose(alone, batched, rtol=1e-12, atol=0)
        expected = profile.calibrated_path_probability(tree).double().clone()
        factor = torch.tensor([1.0] + [controller.acceptance_correction.factor(d) for d in range(1, 8)], dtype=torch.float64)
        expected = expected * factor[tree.depths]
        for depth in range(1, int(tree.depths.max()) + 1):
            level = tree.depths == depth
            expected[level] = torch.minimum(expected[level], expected[tree.parents[level]])
        expected[0] = 1.0
        assert torch.allclose(batched, expected)
    assert any(controller.acceptance_correction.factor(d) != 1.0 for d in (1, 2, 3))


def test_draft_cost_tracker_separates_the_fixed_part_from_the_depths():
    from moe_spec.policy.online_correction import DraftCostTracker

    tracker = DraftCostTracker()
    assert tracker.estimate() == (0.0, 0.0)
    tracker.update(3, 6.0)
    assert tracker.estimate() == (0.0, 2.0)  # one depth seen: spread over the depths
    for depth in (2, 4, 5, 3, 2):
        tracker.update(depth, 3.0 + 1.5 * depth)
    fixed, per_depth = tracker.estimate()
    assert 1.5 <= per_depth < 2.0 and fixed > 0.0
    # computed once per window and prior: a new sample or another prior is a new estimate
    assert tracker.estimate() == (fixed, per_depth) and tracker.estimate(1.0) != (fixed, per_depth)
    tracker.update(6, 40.0)
    fresh = DraftCostTracker(samples=list(tracker.samples))
    assert tracker.estimate() == fresh.estimate() != (fixed, per_depth)
    assert tracker.estimate(1.0) == fresh.estimate(1.0)


def test_learning_from_a_batch_counts_every_verified_node_at_its_depth(profiled):
    _, _, profile = profiled
    trees = [t for t in _forest(3, 9, seed=4)] + [DraftTree.root_only(5)]
    acceptances = [Acceptance([0, 1], 7), Acceptance([0], 7), Acceptance([0, 1, 3], 7), Acceptance([0], 7)]
    controller = MoeAwareController(profile)
    controller.observe(_record(trees, acceptances, 10.0, 1.0))
    expected = AcceptanceCorrection()
    for tree, acceptance in zip(trees, acceptances):  # the definition, node by node
        values = profile.calibrated_path_probability(tree)
        for node, depth in enumerate(tree.depths.tolist()):
            if node:
                expected.update(depth, float(values[node]), float(node in acceptance.path))
    assert controller.acceptance_correction.observed == pytest.approx(expected.observed)
    assert controller.acceptance_correction.predicted == pytest.approx(expected.predicted)
    alone = MoeAwareController(profile)  # one row at a time: learnt node by node in plain Python
    for tree, acceptance in zip(trees, acceptances):
        alone.observe(_record([tree], [acceptance], 10.0, 1.0))
    assert alone.acceptance_correction.observed == pytest.approx(expected.observed)
    assert alone.acceptance_correction.predicted == pytest.approx(expected.predicted)


def test_candidate_trees_go_deeper_only_after_a_choice_used_their_last_level(profiled):
    _, _, profile = profiled
    controller = MoeAwareController(profile, adapt=False)
    default = TreeBudget(60, 5, 10)
    chain = DraftTree.from_lists([1, 2, 3, 4], [-1, 0, 1, 2], scores=[0.0, -0.01, -0.02, -0.03])
    controller.begin(default)
    controller._recent.extend([_Choice(2, 2, False)] * 4)  # chose 2 levels of deeper candidates
    assert controller._next_budget().max_depth == 2
    controller._recent.append(_Choice(3, 3, True))  # a choice reached the candidates' last level
    assert controller._next_budget().max_depth == 4
    plan = controller.plan(StepForest((chain,)), draft_ms=1.0)
    verified = plan.verify[0]
    sized_nodes, sized_depth, edge = controller._recent[-1]
    assert edge == (sized_depth == 3), "the edge is the sized choice's, not the verified set's"
    assert int(verified.depths.max()) >= sized_depth, "drafted nodes are verified at least as deep as sized"


def test_sampled_candidates_are_chains_drafted_at_the_depth_chosen_and_one_deeper_only_when_it_took_them_all(profiled):
    """Sampled trees are verified whole: chains (one draw per node), no overshoot, one level more
    only when the last choice reached the chain's end, the start and a plain step at `sampled_min`."""
    from moe_spec.core.sampling import SamplingConfig

    _, _, profile = profiled
    controller = MoeAwareController(profile, scheme="sampled")
    default = TreeBudget(60, 5, 10)

    def shape():
        budget = controller._next_budget()
        assert budget.sampled and budget.branching == 1 and budget.max_nodes == budget.max_depth, "a chain"
        return budget.max_depth

    first = controller.begin(default, SamplingConfig(temperature=1.0))
    assert first.sampled and (first.max_nodes, first.max_depth, first.branching) == (2, 2, 1)
    controller._recent.append(_Choice(2, 2, False))  # chose 2 of a longer chain
    assert shape() == 2
    controller._recent.append(_Choice(3, 3, True))  # reached the chain's end: the candidates bounded it
    assert shape() == 4
    controller._recent.append(_Choice(1, 1, False))
    assert shape() == controller.settings.sampled_min, "never below `sampled_min`"
    controller._recent.append(_Choice(0, 0, False))  # a plain step
    assert shape() == controller.settings.sampled_min
    controller._recent.append(_Choice(9, 9, True))
    assert shape() == default.max_depth, "capped by the default budget's depth"


def test_sampled_chains_are_sized_from_the_acceptance_chains_reach(profiled):
    """With a profile that measured chains at the request's setting, the chain's length is the one
    of best tokens per ms under that per-depth acceptance and the cost model; each verified chain's
    trials move it; a replay that finds nothing pays skips drafting."""
    from moe_spec.core.sampling import SamplingConfig
    from moe_spec.policy.chain_sizing import best_chain_length
    from moe_spec.profile.sampling_acceptance import SettingAcceptance

    _, _, base = profiled
    default, sampling = TreeBudget(60, 5, 10), SamplingConfig(temperature=0.7, top_p=0.9)

    def controller_with(prior, adapt=True):
        entry = SettingAcceptance(0.7, 0, 0.9, True, 2.0, 10, 60, base.calibration, "chain:5", prior)
        return MoeAwareController(replace(base, sampling_acceptance=(entry,)), scheme="sampled", adapt=adapt)

    sure = controller_with((0.999,) * 5)
    first = sure.begin(default, sampling)
    assert first.sampled and first.branching == 1 and first.max_nodes == first.max_depth == 5, "all pays: the longest"
    never = controller_with((0.001,) * 5, adapt=False)
    assert never.begin(default, sampling).max_nodes == 0, "a replay where no node pays drafts nothing"
    assert controller_with((0.001,) * 5).begin(default, sampling).max_nodes == 1, "measured: the gate decides"

    controller = controller_with((0.7, 0.6, 0.5, 0.4, 0.3))
    budget = controller.begin(default, sampling)
    fixed, per_node = controller._chain_draft_prices()
    expected, _ = best_chain_length(controller._chain.reach(5),
                                    lambda n: (fixed + per_node * n if n else 0.0) + controller._chain_verify_ms(n, 1))
    assert budget.max_nodes == max(expected, 1)
    accepted = Acceptance([0, 1], 9, ((1, 0.9), (2, 0.2)))
    drawn_chain = _drawn_chain()
    plan = controller.plan(StepForest((drawn_chain,)), draft_ms=3.0)
    assert plan.verify.num_nodes == 4, "a sampled chain is verified whole"
    controller.observe(_record([drawn_chain], [accepted], verify_ms=30.0, draft_ms=3.0))
    assert controller._chain.counts == {1: 1, 2: 1} and controller._chain.sums == {1: 0.9, 2: 0.2}


def test_the_gate_measures_a_sampled_chain_by_the_tokens_it_expects_given_its_draws(profiled):
    """A sampled chain's step counts 1 + a_1 + a_1 a_2 + ... from the verification's exact acceptance
    probabilities (past the first rejection, the per-depth acceptance chains reach), not the luck of
    the acceptance draws; with `expect_tokens` off, the tokens made."""
    from moe_spec.core.sampling import SamplingConfig
    from moe_spec.profile.sampling_acceptance import SettingAcceptance

    _, _, base = profiled
    sampling = SamplingConfig(temperature=0.7, top_p=0.9)
    entry = SettingAcceptance(0.7, 0, 0.9, True, 2.0, 10, 60, base.calibration, "chain:5", (0.7, 0.6, 0.5, 0.4, 0.3))
    drawn_chain = _drawn_chain()
    accepted = Acceptance([0, 1], 9, ((1, 0.9), (2, 0.2)))  # node 1 accepted, node 2 tried and rejected
    counted = {}
    for expect in (True, False):
        controller = MoeAwareController(replace(base, sampling_acceptance=(entry,)), scheme="sampled",
                                        expect_tokens=expect)
        controller.begin(TreeBudget(60, 5, 10), sampling)
        controller.plan(StepForest((drawn_chain,)), draft_ms=3.0)
        controller.observe(_record([drawn_chain], [accepted], verify_ms=30.0, draft_ms=3.0))
        counted[expect] = controller.speculation_gate.rates.recent[-1][0]
    assert counted[True] == pytest.approx(1 + 0.9 + 0.9 * 0.2 + 0.9 * 0.2 * 0.5)  # depth 3 untried: the prior's 0.5
    assert counted[False] == 2  # one accepted draft and the bonus token


def _drawn_chain() -> DraftTree:
    """A sampled chain of three drafted nodes over a uniform three-token proposal."""
    chain = DraftTree.from_lists([5, 6, 7, 8], [-1, 0, 1, 2])
    return DraftTree(chain.tokens, chain.parents, chain.scores, torch.full((4, 3), 1 / 3), torch.arange(3),
                     torch.zeros(4, dtype=torch.long))


def _record(trees: list[DraftTree], acceptances: list[Acceptance], verify_ms: float, draft_ms: float) -> StepRecord:
    """The record of a step that verified `trees` (no routing recorded)."""
    forest = StepForest(trees)
    return StepRecord(tuple(range(len(trees))), (10,) * len(trees), tuple(trees), forest, tuple(acceptances),
                      torch.zeros(forest.rows, forest.width, dtype=torch.long), empty_routing(), verify_ms, draft_ms)


def test_the_plan_budgets_the_next_candidates_and_observing_needs_no_flag(profiled):
    """Every step is one plan and one observe: a plain step (nothing drafted) is planned too."""
    _, _, profile = profiled
    for adapt in (False, True):
        controller = MoeAwareController(profile, recent_steps=2, adapt=adapt)
        first = controller.begin(TreeBudget(60, 5, 10))
        assert first.max_nodes > 0
        root = DraftTree.root_only(3)
        for _ in range(2):
            plan = controller.plan(StepForest((root,)), draft_ms=0.0)
            assert len(plan.verify[0]) == 1
            controller.observe(_record([root], [Acceptance([0], 4)], 10.0, 0.0))
        # without measurements the model's plain choices pause drafting; with them only measured rates do
        assert controller._next_budget().drafts_nothing == (not adapt), f"adapt={adapt}"


def test_the_cost_correction_learns_the_machines_speed_and_is_bounded():
    from moe_spec.policy.online_correction import CostCorrection

    correction = CostCorrection()
    for _ in range(30):
        correction.update(10.0, 22.0)  # every pass 2.2x its prediction
    assert correction.scale == pytest.approx(2.2, rel=1e-3)
    correction.update(10.0, 0.0)  # a pass without a time teaches nothing
    assert correction.scale == pytest.approx(2.2, rel=1e-3)
    for _ in range(30):
        correction.update(1.0, 1e6)
    assert correction.scale == pytest.approx(correction.high)


def test_a_batchs_extra_cost_is_learnt_per_row_at_the_one_row_scale():
    from moe_spec.policy.online_correction import CostCorrection

    correction = CostCorrection()
    for _ in range(30):
        correction.update(10.0, 20.0)  # one row: the machine runs at half the profiled speed
    correction.update(30.0, 75.0, rows=16)  # 16 rows: 15 ms of per-row work on top of 2x
    assert correction.row_ms == pytest.approx(1.0, rel=1e-3), "the first batched pass sets the per-row work, not a fraction of it"
    for _ in range(30):
        correction.update(30.0, 75.0, rows=16)
    assert correction.scale == pytest.approx(2.0, rel=1e-3), "batched passes leave the speed as one row set it"
    assert correction.offset_ms(16) == pytest.approx(15.0, rel=1e-3)
    assert correction.offset_ms(4) == pytest.approx(3.0, rel=1e-3), "a batch of fewer rows: less of that work"
    assert correction.offset_ms(1) == 0.0


def test_the_gate_compares_with_a_predicted_plain_step_until_one_is_measured():
    from moe_spec.policy.online_correction import ThroughputTracker

    rates = ThroughputTracker()
    for _ in range(rates.min_speculative_steps):
        rates.update(True, 2, 50.0)  # 0.04 tokens per ms
    assert rates.speculation_loses(plain_ms=20.0), "a 20 ms plain step (0.05/ms) beats it"
    assert not rates.speculation_loses(plain_ms=30.0)
    assert not rates.speculation_loses(), "nothing to compare with"
    rates.update(False, 1, 30.0)  # measured plain steps replace the prediction
    assert not rates.speculation_loses(plain_ms=20.0)


def test_the_gate_closes_on_evidence_not_on_a_few_unlucky_steps():
    from moe_spec.policy.online_correction import ThroughputTracker

    unlucky = ThroughputTracker()
    for tokens in (1, 1, 4, 1):  # 7 tokens in 160 ms: under a 20 ms plain step's rate, by luck
        unlucky.update(True, tokens, 40.0)
    se = unlucky.standard_error()
    assert unlucky.speculative < 1 / 20.0 < unlucky.speculative + se
    assert not unlucky.speculation_loses(plain_ms=20.0), "within one standard error of plain: keep drafting"
    losing = ThroughputTracker()
    for tokens in (1, 1, 2, 1, 1, 1, 2, 1):
        losing.update(True, tokens, 40.0)
    assert losing.speculation_loses(plain_ms=20.0), "consistently under plain: stop drafting"


def test_observing_learns_what_predicting_the_pass_afresh_would(profiled):
    """observe reuses the routing and calibrated values its plan computed: the corrections it
    learns equal those of a controller that predicts the verified pass and its values afresh."""
    _, _, profile = profiled
    if not profile.cost_model.num_layers:
        pytest.skip("a dense target has no routing to reuse")
    for rows, seed in ((1, 7), (1, 8), (3, 9)):
        trees = _forest(rows, 9, seed=seed)
        reused, afresh = MoeAwareController(profile), MoeAwareController(profile)
        for controller in (reused, afresh):
            controller.begin(TreeBudget(60, 5, 10))
            # prices at another speed than profiled, with a batch's offset: the plan's prediction
            # must still come back in the profile's own prices
            controller.cost_correction.log_scale, controller.cost_correction.row_ms = 0.6, 0.5
        plan = reused.plan(StepForest(trees), draft_ms=2.0)
        verified = list(plan.verify)
        acceptances = [Acceptance([0] + ([1] if tree.num_drafted else []), 3) for tree in verified]
        record = _record(verified, acceptances, verify_ms=30.0, draft_ms=2.0)
        assert reused._verify_plan.predicted_ms == pytest.approx(afresh.predicted_verify_ms(record.verified))
        reused.observe(record)
        afresh.cost_correction.update(afresh.predicted_verify_ms(record.verified), record.verify_ms, rows=rows)
        afresh._learn_acceptance(record)
        assert reused.cost_correction.scale == pytest.approx(afresh.cost_correction.scale)
        assert reused.cost_correction.row_ms == pytest.approx(afresh.cost_correction.row_ms)
        assert reused.acceptance_correction.observed == pytest.approx(afresh.acceptance_correction.observed)
        assert reused.acceptance_correction.predicted == pytest.approx(afresh.acceptance_correction.predicted)


def test_the_gate_compares_a_batch_with_a_plain_pass_of_the_whole_batch(profiled):
    """B rows make B tokens a plain pass: before one is measured, the gate's plain rate is the
    predicted batched pass's, not one row's (which no batched speculation could fall below)."""
    _, _, profile = profiled
    controller = MoeAwareController(profile)
    controller.begin(TreeBudget(60, 5, 10))
    one_row = controller._plain_rate()
    controller.plan(StepForest(_forest(16, 5, seed=2)), draft_ms=1.0)
    batched = controller._plain_rate()
    assert batched == pytest.approx(16 / (controller.prices.plain_pass_ms(16) * controller.cost_correction.scale))
    assert batched > 4 * one_row, "a plain pass of 16 rows makes far more tokens per ms than one of 1"
    for _ in range(controller.speculation_gate.rates.min_speculative_steps):
        controller.speculation_gate.rates.update(True, 16, 16 / (4 * one_row))  # 4x one row's rate: under the batch's
    assert controller.speculation_gate.rates.speculation_loses(plain_rate=batched)
    assert controller._next_budget().drafts_nothing or controller.speculation_gate.paused_steps % controller.speculation_gate.probe_every == 0


def test_the_gate_measures_afresh_when_rows_leave_the_batch(profiled):
    """Steps of 16 rows make more tokens a ms than steps of 3, speculative or plain: the gate holds
    a window of one batch size against plain steps of the same size only."""
    _, _, profile = profiled
    controller = MoeAwareController(profile)
    controller.begin(TreeBudget(60, 5, 10))
    wide, narrow = _forest(16, 3, seed=4), _forest(3, 3, seed=5)
    roots = [DraftTree.root_only(int(tree.tokens[0])) for tree in wide]
    controller.observe(_record(roots, [Acceptance([0], 1)] * 16, verify_ms=40.0, draft_ms=0.0))  # 0.4 tokens a ms
    assert controller.speculation_gate.rates.plain == pytest.approx(0.4)
    for _ in range(controller.speculation_gate.rates.min_speculative_steps):  # 3 rows, 2 tokens each in 30 ms: 0.2 a ms
        controller.observe(_record(narrow, [Acceptance([0, 1], 2)] * 3, verify_ms=30.0, draft_ms=0.0))
    assert controller.speculation_gate.rates.plain is None, "the 16-row plain rate is not held against 3-row steps"
    assert len(controller.speculation_gate.rates.recent) == controller.speculation_gate.rates.min_speculative_steps


def test_the_cost_correction_tells_the_price_of_reads_from_the_machines_speed():
    from moe_spec.policy.online_correction import CostCorrection

    exact, shrunk = CostCorrection(fetch_shrink=0.0), CostCorrection()
    passes = [(10.0, 0.0), (12.0, 4.0), (9.0, 12.0), (15.0, 2.0), (11.0, 20.0), (10.0, 0.0)]  # (compute, fetch) predicted
    for _ in range(10):
        for compute, fetch in passes:
            for correction in (exact, shrunk):  # reads cost 1.9x their price, compute 1.2x
                correction.update(compute, 1.2 * compute + 1.9 * fetch, fetch_ms=fetch)
    assert exact.fetch_scale == pytest.approx(1.9, rel=1e-3)
    assert exact.scale == pytest.approx(1.2, rel=1e-3), "the speed, learnt beyond the reads at their price"
    # shrunk towards the profile's price by a tenth of its own evidence
    assert 1.8 < shrunk.fetch_scale < 1.9
    assert shrunk.scale == pytest.approx(1.2, rel=0.06)


def test_reads_in_one_proportion_or_none_leave_the_profiles_fetch_price():
    from moe_spec.policy.online_correction import CostCorrection

    unread, proportional = CostCorrection(), CostCorrection()
    for _ in range(30):
        unread.update(10.0, 22.0)
        proportional.update(10.0, 30.0, fetch_ms=5.0)  # every pass reads half its compute: not told apart
    assert unread.fetch_scale == 1.0 and unread.scale == pytest.approx(2.2, rel=1e-3), "resident, as before"
    assert proportional.fetch_scale == pytest.approx(1.0)
    assert proportional.scale == pytest.approx(2.5, rel=1e-3), "the whole difference is the machine's speed"


def test_the_fetch_price_is_bounded_and_a_batch_pays_its_reads_at_it():
    from moe_spec.policy.online_correction import CostCorrection

    correction = CostCorrection()
    for _ in range(40):
        correction.update(10.0, 10.0, fetch_ms=0.0)
        correction.update(10.0, 10.0 + 1000.0, fetch_ms=1.0)  # a read costing 1000x its price
    assert correction.fetch_scale == correction.high
    before = correction.row_ms
    correction.update(20.0, correction.scale * 20.0 + correction.high * 3.0 + 15.0, rows=16, fetch_ms=3.0)
    assert correction.row_ms == pytest.approx(1.0, rel=1e-6) and before == 0.0, "the reads are not per-row work"
