"""The step economics behind the controllers, checked against brute force on small trees."""

import itertools
import random

import torch

from moe_spec.cost_model import CostModel
from moe_spec.selection import StepPrices, best_first_subtree, best_prefix_by_score, subset_objective
from moe_spec.tree import DraftTree


def _connected_subsets(tree: DraftTree):
    """Every node set containing the root and closed under parents."""
    parents = tree.parents.tolist()
    for size in range(len(tree)):
        for combo in itertools.combinations(range(1, len(tree)), size):
            keep = {0, *combo}
            if all(parents[i] in keep for i in combo):
                yield sorted(keep)


def _random_case(rng: random.Random, n: int, layers: int = 2, experts: int = 8):
    parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    tree = DraftTree.from_lists([rng.randrange(50) for _ in range(n)], parents)
    conditional = [1.0] + [rng.uniform(0.05, 0.95) for _ in range(1, n)]
    values = torch.ones(n, dtype=torch.float64)
    for i in range(1, n):
        values[i] = values[parents[i]] * conditional[i]
    probs = torch.zeros(layers, n, experts, dtype=torch.float64)
    for layer in range(layers):
        for node in range(n):
            probs[layer, node, rng.sample(range(experts), 2)] = 1.0  # top-2 routing, known exactly
    cost = CostModel(base_ms=rng.uniform(5, 20), per_token_ms=rng.uniform(0.05, 0.5),
                     per_expert_ms=(rng.uniform(0.1, 2.0),), num_layers=layers)
    return tree, StepPrices(values, probs, draft_ms=rng.uniform(0, 5)), cost


def test_best_first_matches_brute_force_on_small_trees():
    rng = random.Random(0)
    exact = 0
    cases = 150
    for _ in range(cases):
        tree, prices, cost = _random_case(rng, rng.randint(2, 9))
        optimum = max(subset_objective(cost, prices, keep) for keep in _connected_subsets(tree))
        chosen = best_first_subtree(tree, prices, cost)
        achieved = subset_objective(cost, prices, chosen)
        assert achieved <= optimum + 1e-12
        assert achieved >= 0.97 * optimum, "greedy growth stays within 3% of the optimum"
        exact += achieved >= optimum - 1e-12
    assert exact >= 0.9 * cases, f"best-first found the exact optimum in only {exact}/{cases} cases"


def test_chosen_sets_are_connected_and_contain_the_root():
    rng = random.Random(1)
    for _ in range(50):
        tree, prices, cost = _random_case(rng, rng.randint(1, 30))
        chosen = best_first_subtree(tree, prices, cost)
        assert chosen[0] == 0
        tree.subtree(chosen)  # raises unless closed under parents


def test_expert_pricing_prefers_the_sibling_that_reuses_the_roots_experts():
    # two equally likely children; child 1 routes like the root, child 2 to new experts
    tree = DraftTree.from_lists([7, 8, 9], [-1, 0, 0])
    probs = torch.zeros(1, 3, 8, dtype=torch.float64)
    probs[0, 0, [0, 1]] = 1
    probs[0, 1, [0, 1]] = 1
    probs[0, 2, [5, 6]] = 1
    values = torch.tensor([1.0, 0.3, 0.3], dtype=torch.float64)
    cost = CostModel(base_ms=1.0, per_token_ms=0.1, per_expert_ms=(2.0,), num_layers=1)
    chosen = best_first_subtree(tree, StepPrices(values, probs, 0.0), cost)
    assert chosen == [0, 1]
    # without expert prices both children are worth their token cost
    assert sorted(best_first_subtree(tree, StepPrices(values, None, 0.0), cost)) == [0, 1, 2]


def test_no_speculation_when_it_cannot_pay():
    tree = DraftTree.from_lists([7, 8, 9, 10], [-1, 0, 1, 0])
    values = torch.tensor([1.0, 0.01, 0.005, 0.02], dtype=torch.float64)
    cost = CostModel(base_ms=1.0, per_token_ms=5.0, per_expert_ms=(0.0,), num_layers=0)
    assert best_first_subtree(tree, StepPrices(values, None, 0.0), cost) == [0]


def test_prefix_truncation_keeps_the_best_score_prefix():
    tree = DraftTree.from_lists([1, 2, 3, 4], [-1, 0, 1, 0], scores=[0.0, -0.1, -0.3, -2.0])
    values = torch.tensor([1.0, 0.9, 0.8, 0.05], dtype=torch.float64)
    keep = best_prefix_by_score(tree, values, lambda t: 10.0 + 1.0 * t, draft_ms=0.0)
    assert keep == [0, 1, 2]
    assert best_prefix_by_score(tree, values, lambda t: 1.0 + 10.0 * t, draft_ms=0.0) == [0]
