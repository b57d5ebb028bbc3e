"""The fetch term of the cost model and the residency pricing built on it."""

import numpy as np
import pytest
import torch

from moe_spec.core.tree import DraftTree
from moe_spec.policy.selection import StepPrices, best_first_forest, subset_verify_ms
from moe_spec.profile.cost_model import CostModel
from moe_spec.profile.fetch_cost import FetchCost

FETCH = FetchCost(counts=(1, 2, 4, 8), ms=((1.0, 1.5, 2.5, 4.0), (2.0, 3.0, 5.0, 9.0)))


def test_fetch_cost_interpolates_the_measured_grid_from_zero():
    np.testing.assert_allclose(FETCH.layer_ms([0, 0]), [0.0, 0.0])
    np.testing.assert_allclose(FETCH.layer_ms([2, 4]), [1.5, 5.0])
    np.testing.assert_allclose(FETCH.layer_ms([3, 0.5]), [2.0, 1.0])
    # beyond the grid: the last segment's slope (0.375 and 1.0 ms per miss)
    np.testing.assert_allclose(FETCH.layer_ms([16, 10]), [4.0 + 8 * 0.375, 9.0 + 2 * 1.0])


def test_miss_price_falls_as_parallel_reads_amortise():
    first = FETCH.miss_price([0, 0], added=1)
    later = FETCH.miss_price([4, 4], added=4)
    np.testing.assert_allclose(first, [1.0, 2.0])
    assert (later < first).all()


def test_the_fetch_scale_prices_every_read_and_round_trips():
    from dataclasses import replace

    hidden = replace(FETCH, scale=0.4, overflow_ms=0.5, capacity=2)
    np.testing.assert_allclose(hidden.layer_ms([2, 4]), [0.4 * 1.5, 0.4 * 5.0])
    np.testing.assert_allclose(hidden.miss_price([0, 0]), [0.4, 0.8])
    assert hidden.total_ms([2, 4], unique=[3, 2]) == pytest.approx(0.4 * 6.5 + 0.5), "the overflow is not scaled"
    assert FetchCost.from_dict(hidden.to_dict()) == hidden
    older = hidden.to_dict()
    del older["scale"]  # a profile from before the scale was fitted: reads priced as timed alone
    assert FetchCost.from_dict(older).scale == 1.0
    for bad in (-0.1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="fetch scale"):
            replace(FETCH, scale=bad)


def test_a_scaled_cost_model_scales_compute_and_reads_apart():
    from dataclasses import replace

    cost = CostModel(base_ms=10.0, per_token_ms=1.0, per_expert_ms=(0.5,), num_layers=2,
                     fetch=replace(FETCH, scale=0.8, overflow_ms=0.5, capacity=1))
    scaled = cost.scaled(2.0, fetch_factor=1.5)  # compute at half the speed, reads at 1.5x their price
    assert scaled.predict_ms(3, [2, 2]) == pytest.approx(2.0 * (10 + 3 + 2.0))
    reads = cost.fetch.total_ms([2, 1], unique=[2, 2])
    assert scaled.fetch.total_ms([2, 1], unique=[2, 2]) == pytest.approx(1.5 * reads), "the overflow read too"
    np.testing.assert_allclose(scaled.fetch.miss_price([0, 0]), 1.5 * cost.fetch.miss_price([0, 0]))
    assert cost.scaled(2.0).fetch is cost.fetch, "reads at their price unless told otherwise"


@pytest.mark.parametrize("counts, ms", [((2, 1), ((1.0, 1.0),)), ((0, 1), ((1.0, 1.0),)), ((1,), ((float("nan"),),))])
def test_fetch_cost_refuses_a_bad_grid(counts, ms):
    with pytest.raises(ValueError):
        FetchCost(counts, ms)


def test_cost_model_adds_the_fetch_of_missing_experts_and_round_trips():
    cost = CostModel(base_ms=10.0, per_token_ms=1.0, per_expert_ms=(0.5,), num_layers=2, fetch=FETCH)
    assert cost.predict_ms(3, [2, 2]) == pytest.approx(10 + 3 + 2.0)  # misses not given: compute only
    assert cost.predict_ms(3, [2, 2], misses=[2, 1]) == pytest.approx(10 + 3 + 2.0 + 1.5 + 2.0)
    again = CostModel.from_dict(cost.to_dict())
    assert again == cost
    assert "m_l(M[l])" in cost.to_dict()["formula"]
    with pytest.raises(ValueError, match="fetch cost has 2 layers"):
        CostModel(base_ms=1.0, per_token_ms=1.0, per_expert_ms=(0.5,), num_layers=3, fetch=FETCH)


def _two_children_case():
    """A root with two equally likely children: child 1 routes to experts 0-1, child 2 to experts 2-3."""
    tree = DraftTree.from_lists([5, 6, 7], [-1, 0, 0])
    probs = torch.zeros(2, 3, 8, dtype=torch.float64)  # [L, N, E]
    probs[:, 0, [4, 5]] = 1.0  # the root
    probs[:, 1, [0, 1]] = 1.0
    probs[:, 2, [2, 3]] = 1.0
    values = torch.tensor([1.0, 0.4, 0.4], dtype=torch.float64)
    cost = CostModel(base_ms=5.0, per_token_ms=0.2, per_expert_ms=(0.1,), num_layers=2,
                     fetch=FetchCost((1, 2, 4), ((1.0, 1.8, 3.0), (1.0, 1.8, 3.0))))
    return tree, StepPrices(values, probs), cost


def test_a_node_whose_experts_are_resident_is_preferred_to_one_that_misses():
    tree, prices, cost = _two_children_case()
    residency = torch.zeros(2, 8, dtype=torch.bool)
    residency[:, [2, 3, 4, 5]] = True  # child 2's experts and the root's are resident
    keep = best_first_forest([tree], [prices], cost, depth_ms=0.0, residency=residency, max_nodes=1)[0]
    assert keep == [0, 2]
    residency = torch.zeros(2, 8, dtype=torch.bool)
    residency[:, [0, 1, 4, 5]] = True  # now child 1's are
    assert best_first_forest([tree], [prices], cost, depth_ms=0.0, residency=residency, max_nodes=1)[0] == [0, 1]


def test_cold_experts_make_speculation_not_pay_where_warm_ones_do():
    tree, prices, cost = _two_children_case()
    warm = torch.ones(2, 8, dtype=torch.bool)
    cold = torch.zeros(2, 8, dtype=torch.bool)
    cold[:, [4, 5]] = True  # only the root's experts are resident
    assert len(best_first_forest([tree], [prices], cost, 0.0, residency=warm)[0]) == 3
    assert best_first_forest([tree], [prices], cost, 0.0, residency=cold)[0] == [0]
    # the price it acted on is the cost model's: verifying child 1 cold costs its two misses per layer
    cold_ms = subset_verify_ms(cost, [0, 1], prices.expert_probs, residency=cold)
    warm_ms = subset_verify_ms(cost, [0, 1], prices.expert_probs, residency=warm)
    assert cold_ms - warm_ms == pytest.approx(2 * 1.8)


def test_experts_beyond_the_resident_slots_cost_the_overflow_price_at_the_runs_capacity():
    fetch = FetchCost((1, 2, 4, 8), FETCH.ms, overflow_ms=0.7, capacity=4)
    np.testing.assert_allclose(fetch.overflow([3, 6.5]), [0.0, 2.5])
    assert fetch.total_ms([2, 4], unique=[3, 6.5]) == pytest.approx(1.5 + 5.0 + 0.7 * 2.5)
    assert fetch.total_ms([2, 4]) == pytest.approx(1.5 + 5.0), "without the pass's experts: misses alone"
    assert fetch.at_capacity(8).total_ms([2, 4], unique=[3, 6.5]) == pytest.approx(6.5), "a larger cache: none beyond"
    unpriced = FetchCost((1, 2, 4, 8), FETCH.ms, overflow_ms=0.7)
    assert unpriced.total_ms([2, 4], unique=[3, 6.5]) == pytest.approx(6.5), "no capacity: no overflow priced"
    cost = CostModel(base_ms=10.0, per_token_ms=1.0, per_expert_ms=(0.5,), num_layers=2, fetch=fetch)
    assert cost.predict_ms(3, [3, 6], misses=[2, 4]) == pytest.approx(10 + 3 + 0.5 * 9 + 1.5 + 5.0 + 0.7 * 2)
    assert CostModel.from_dict(cost.to_dict()) == cost
    assert FetchCost.from_dict(FETCH.to_dict()) == FETCH, "a profile from before the overflow term prices none"
    with pytest.raises(ValueError, match="overflow"):
        FetchCost((1,), ((1.0,), (1.0,)), overflow_ms=-1.0)
    with pytest.raises(ValueError, match="capacity"):
        FetchCost((1,), ((1.0,), (1.0,)), capacity=-1)


def _wide_tree_case(overflow_ms: float):
    """A root loading experts 0-1 and four children, each loading two cold experts of its own, in a
    cache of 4 slots a layer: the first child fills the slots, every further child's experts overflow."""
    tree = DraftTree.from_lists([5, 6, 7, 8, 9], [-1, 0, 0, 0, 0])
    probs = torch.zeros(2, 5, 12, dtype=torch.float64)  # [L, N, E]
    probs[:, 0, [0, 1]] = 1.0
    for child in range(1, 5):
        probs[:, child, [2 * child, 2 * child + 1]] = 1.0
    values = torch.tensor([1.0, 0.3, 0.3, 0.3, 0.3], dtype=torch.float64)
    fetch = FetchCost((1, 2, 4, 8), ((0.4, 0.6, 1.0, 1.8),) * 2, overflow_ms=overflow_ms, capacity=4)
    cost = CostModel(base_ms=5.0, per_token_ms=0.2, per_expert_ms=(0.05,), num_layers=2, fetch=fetch)
    residency = torch.zeros(2, 12, dtype=torch.bool)
    residency[:, [0, 1]] = True
    return tree, StepPrices(values, probs), cost, residency


def test_the_growth_prices_experts_beyond_the_slots_and_verifies_fewer_nodes_for_it():
    tree, prices, plain, residency = _wide_tree_case(overflow_ms=0.0)
    _, _, dear, _ = _wide_tree_case(overflow_ms=2.0)
    unpriced = best_first_forest([tree], [prices], plain, 0.0, residency=residency)[0]
    priced = best_first_forest([tree], [prices], dear, 0.0, residency=residency)[0]
    assert len(unpriced) == 5 and len(priced) == 2, "the first child fits the slots; the others overflow"
    # the pass's price is the cost model's: two experts a layer beyond the 4 slots for a second child
    two = subset_verify_ms(dear, [0, 1, 2], prices.expert_probs, residency=residency)
    assert two - subset_verify_ms(plain, [0, 1, 2], prices.expert_probs, residency=residency) == pytest.approx(2 * 2 * 2.0)
