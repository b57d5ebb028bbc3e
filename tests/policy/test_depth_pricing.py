"""`DepthPricer`: the values it carries are the controller's calibrated path products, it stops a
depth exactly where its bound says nothing there could pay, and moe-aware hands one to the drafter
of top candidates (never of sampled ones) and counts the forwards drafting ran with it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moe_spec import SpecDecoder
from moe_spec.core.drafting import TreeBudget
from moe_spec.core.forest import StepForest
from moe_spec.core.sampling import SamplingConfig
from moe_spec.core.target import TargetModel
from moe_spec.core.tree import DraftTree
from moe_spec.drafters.eagle import EagleDrafter
from moe_spec.measure.latency import TimingConfig
from moe_spec.measure.profiler import ProfileSettings, build_profile
from moe_spec.policy.draft_pricing import DepthPricer
from moe_spec.policy.moe_aware import MoeAwareController
from moe_spec.testing.helpers import PLAIN_PROMPT, REPETITIVE_PROMPT, hf_greedy, random_eagle_head
from moe_spec.testing.tiny_models import tiny_model

torch.set_num_threads(1)
QUICK = ProfileSettings(
    max_new_tokens=16, prefix_len=16, grid_tokens=(1, 4, 16), grid_experts=(2, 4, 8), natural_trees=6,
    curve_sizes=(1, 2, 4, 8), timing=TimingConfig(repeats=2, warmup=1, evict_mb=0),
)


@pytest.fixture(scope="module")
def setup():
    model = tiny_model("qwen3_moe")
    target = TargetModel(model)
    head = random_eagle_head(target, 64)
    prompts = [torch.tensor(p) for p in (REPETITIVE_PROMPT, PLAIN_PROMPT, REPETITIVE_PROMPT[3:] * 2)]
    profile = build_profile(target, EagleDrafter(head, target), prompts, QUICK)
    return model, target, head, profile


def test_child_values_are_the_controllers_calibrated_path_products(setup):
    _, _, _, profile = setup
    controller = MoeAwareController(profile)
    pricer = DepthPricer(profile.calibration, lambda depth: 1.0, rate=0.1, node_ms=1.0, depth_ms=1.0)
    # a root with three children (by score), the first of which has two children
    log_q1 = np.log(np.array([[[0.5, 0.3, 0.1]]]))  # [B=1, M=1, w=3]
    log_q2 = np.log(np.array([[[0.6, 0.2]]]))
    level1 = pricer.child_values(1, [[1.0]], log_q1.tolist())  # [1][3]
    level2 = pricer.child_values(2, [level1[0][:1]], log_q2.tolist())  # [1][2]
    scores = np.concatenate([[0.0], log_q1[0, 0], log_q1[0, 0, 0] + log_q2[0, 0]])
    tree = DraftTree.from_lists([1, 2, 3, 4, 5, 6], [-1, 0, 0, 0, 1, 1], scores=scores.tolist())
    expected = controller._calibrated_afresh(StepForest((tree,)))
    assert np.allclose(level1[0] + level2[0], expected[1:])
    assert pricer.forwards == 2
    # rows and parents side by side, slot by slot; a parent of value 0 (a placeholder) has children of value 0
    both = pricer.child_values(2, [[level1[0][0], 0.0], [level1[0][0], level1[0][1]]], [[log_q2[0, 0].tolist()] * 2] * 2)
    assert np.allclose(both[0], level2[0] + [0.0, 0.0])
    assert np.allclose(both[1][:2], level2[0]) and both[1][2] == pytest.approx(level1[0][1] / level1[0][0] * level2[0][0])


def test_a_depth_is_drafted_only_where_its_bound_pays(setup):
    _, _, _, profile = setup
    pricer = DepthPricer(profile.calibration, lambda depth: 1.0, rate=0.01, node_ms=1.0, depth_ms=2.0)
    best = pricer._best_conditional(2)
    assert 0 < best <= 1
    # surplus of a frontier node of value v: v * best / rate - node_ms (ms worth of tokens at most)
    v_pays = (1.0 + 2.5) * 0.01 / best  # alone it covers node_ms and more than depth_ms
    v_alone_short = (1.0 + 1.5) * 0.01 / best  # pays its node, not the depth
    assert pricer.worth_expanding(2, [[v_pays, 0.0]]) == [True]
    assert pricer.worth_expanding(2, [[v_alone_short, 0.0]]) == [False]
    assert pricer.worth_expanding(2, [[v_alone_short, v_alone_short]]) == [True], \
        "two frontier nodes together pay for the depth"
    # a batch: a row whose frontier adds nothing stops; the others go on when together they pay
    rows = pricer.worth_expanding(2, [[v_pays, 0.0], [0.001, 0.0]])
    assert rows == [True, False]
    with pytest.raises(ValueError, match="rate"):
        DepthPricer(profile.calibration, lambda depth: 1.0, rate=0.0, node_ms=1.0, depth_ms=1.0)


@pytest.mark.parametrize("seed", range(5))
def test_the_rows_stopped_follow_the_bound_on_random_frontiers(setup, seed):
    """Against the bound written out in numpy: row b goes on iff its frontier's surplus
    sum_m max(0, min(v f, 1) c / rate - node_ms) is positive and all rows' together exceed depth_ms."""
    _, _, _, profile = setup
    rng = np.random.default_rng(seed)
    rate, node_ms, depth_ms, factor = 0.02, 1.0, float(rng.uniform(0, 30)), float(rng.uniform(0.5, 2.0))
    pricer = DepthPricer(profile.calibration, lambda depth: factor, rate, node_ms, depth_ms)
    values = rng.uniform(0, 0.4, (6, 4)) * (rng.random((6, 4)) < 0.7)  # [B, M], 0: no node
    surplus = np.maximum(np.minimum(values * factor, 1.0) * pricer._best_conditional(3) / rate - node_ms, 0).sum(1)
    expected = ((surplus > 0) & (surplus.sum() > depth_ms)).tolist()
    assert pricer.worth_expanding(3, values.tolist()) == expected


def test_moe_aware_prices_depths_of_top_candidates_only_and_counts_their_forwards(setup):
    model, target, head, profile = setup
    controller = MoeAwareController(profile)
    drafter = EagleDrafter(head, target)
    budgets = []
    plan = controller.plan

    def watched(candidates, draft_ms):
        budgets.append((controller._asked, candidates.num_drafted > 0))
        return plan(candidates, draft_ms)

    controller.plan = watched
    decoder = SpecDecoder(target, drafter=drafter, controller=controller)
    prompt = REPETITIVE_PROMPT * 2
    result = decoder.generate(torch.tensor([prompt]), max_new_tokens=24)
    assert torch.equal(result.sequences, hf_greedy(model, prompt, 24))
    priced = [(b, drafted) for b, drafted in budgets if b.pricer is not None]
    assert priced, "after the first growth every top-candidate budget carries a pricer"
    assert budgets[0][0].pricer is None, "nothing to price with before a growth and a measured draft"
    # a step with one token left drafts nothing whatever the budget (the engine skips the drafter)
    assert all((b.pricer.forwards >= 1) == drafted for b, drafted in priced)

    sampled = MoeAwareController(profile, scheme="sampled")
    budgets.clear()
    plan_sampled = sampled.plan
    sampled.plan = lambda candidates, draft_ms: budgets.append(sampled._asked) or plan_sampled(candidates, draft_ms)
    SpecDecoder(target, drafter=drafter, controller=sampled).generate(
        torch.tensor([prompt]), max_new_tokens=16, temperature=1.0, generator=torch.Generator().manual_seed(0))
    drafted = [b for b in budgets if not b.drafts_nothing]
    assert drafted and all(b.pricer is None and b.sampled for b in drafted)


def test_the_draft_cost_tracker_reads_the_forwards_counted(setup):
    _, _, _, profile = setup
    controller = MoeAwareController(profile)
    chain = StepForest((DraftTree.from_lists([1, 2, 3], [-1, 0, 1], scores=[0.0, -0.1, -0.2]),))
    pricer = DepthPricer(profile.calibration, lambda depth: 1.0, rate=0.1, node_ms=1.0, depth_ms=1.0)
    controller._asked = TreeBudget(6, 5, 2, pricer=pricer)
    assert controller._forwards_run(chain) == 3, "not counted: depth 2 plus the forward that found nothing to keep"
    pricer.forwards = 2
    assert controller._forwards_run(chain) == 2, "counted: drafting stopped before a third forward"


def test_controller_without_pricing_depths_drafts_as_before(setup):
    _, _, _, profile = setup
    for price_depths in (False, True):
        controller = MoeAwareController(profile, price_depths=price_depths)
        controller.begin(TreeBudget(60, 5, 10))
        controller._depth_prices = (0.1, 1.0)
        controller.draft_costs.update(2, 4.0)
        assert isinstance(controller._depth_pricer(), DepthPricer) if price_depths else controller._depth_pricer() is None


def test_a_sampled_tree_is_priced_by_the_experts_a_tree_its_size_loads_on_average(setup):
    """Its plan sizes the next tree only, whose tokens are not drawn yet: no routing is predicted,
    and the whole tree's price is the cost model at the profile's unique-experts curve."""
    _, _, _, profile = setup
    controller = MoeAwareController(profile, scheme="sampled", adapt=False)
    controller.begin(TreeBudget(60, 5, 10), SamplingConfig(temperature=1.0))
    chain = DraftTree(torch.tensor([1, 2, 3, 4]), torch.tensor([-1, 0, 1, 2]), torch.tensor([0.0, -0.5, -1.0, -1.5]),
                      proposals=torch.full((4, 64), 1 / 64), proposal_ids=torch.arange(64), draw_rank=torch.zeros(4, dtype=torch.long))
    forest = StepForest((chain,))
    controller._expert_probs = lambda forest: pytest.fail("no routing is predicted for a sampled tree")
    plan = controller.plan(forest, draft_ms=1.0)
    assert plan.verify.num_nodes == 4, "verified whole"
    cost = profile.cost_model
    whole = cost.predict_ms(4, profile.unique_experts_curve.real_at(4))
    assert controller._verify_plan.predicted_ms == pytest.approx(whole)
    priced = controller.prices.with_expected_experts(cost, forest.num_drafted)
    assert priced.fixed_ms() + priced.per_token_ms * 4 == pytest.approx(whole), "tokens alone price the experts"
