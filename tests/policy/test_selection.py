"""The step economics behind the controllers, checked against brute force on small trees."""

import itertools
import random

import numpy as np
import pytest
import torch

from moe_spec.profile.cost_model import CostModel
from moe_spec.policy.selection import (
    StepPrices,
    best_first_forest,
    best_first_subtree,
    best_prefix_by_score,
    grow_forest,
    subset_objective,
    subset_verify_ms,
    throughput,
)
from moe_spec.core.tree import DraftTree


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
    return tree, StepPrices(values, probs), cost, rng.uniform(0, 2)


def test_best_first_matches_brute_force_on_small_trees():
    rng = random.Random(0)
    exact = 0
    cases = 150
    for _ in range(cases):
        tree, prices, cost, depth_ms = _random_case(rng, rng.randint(2, 9))
        optimum = max(subset_objective(cost, tree, prices, keep, depth_ms) for keep in _connected_subsets(tree))
        chosen = best_first_subtree(tree, prices, cost, depth_ms)
        achieved = subset_objective(cost, tree, prices, chosen, depth_ms)
        assert achieved <= optimum + 1e-12
        assert achieved >= 0.97 * optimum, "greedy growth stays within 3% of the optimum"
        exact += achieved >= optimum - 1e-12
    assert exact >= 0.9 * cases, f"best-first found the exact optimum in only {exact}/{cases} cases"


def test_chosen_sets_are_connected_and_contain_the_root():
    rng = random.Random(1)
    for _ in range(50):
        tree, prices, cost, depth_ms = _random_case(rng, rng.randint(1, 30))
        chosen = best_first_subtree(tree, prices, cost, depth_ms)
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
    chosen = best_first_subtree(tree, StepPrices(values, probs), cost)
    assert chosen == [0, 1]
    # without expert prices both children are worth their token cost
    assert sorted(best_first_subtree(tree, StepPrices(values, None), cost)) == [0, 1, 2]


def test_no_speculation_when_it_cannot_pay():
    tree = DraftTree.from_lists([7, 8, 9, 10], [-1, 0, 1, 0])
    values = torch.tensor([1.0, 0.01, 0.005, 0.02], dtype=torch.float64)
    cost = CostModel(base_ms=1.0, per_token_ms=5.0, per_expert_ms=(0.0,), num_layers=0)
    assert best_first_subtree(tree, StepPrices(values, None), cost) == [0]


def test_prefix_truncation_keeps_the_best_score_prefix():
    tree = DraftTree.from_lists([1, 2, 3, 4], [-1, 0, 1, 0], scores=[0.0, -0.1, -0.3, -2.0])
    values = torch.tensor([1.0, 0.9, 0.8, 0.05], dtype=torch.float64)
    keep = best_prefix_by_score(tree, values, lambda t: 10.0 + 1.0 * t, draft_ms=0.0)
    assert keep == [0, 1, 2]
    assert best_prefix_by_score(tree, values, lambda t: 1.0 + 10.0 * t, draft_ms=0.0) == [0]


def reference_best_first_forest(trees, prices, cost, depth_ms, max_nodes=None, patience=None, draft_fixed_ms=0.0):
    """Best-first growth over a padded batch written plainly: every iteration prices every frontier
    node from scratch (the experts no chosen node loads yet; B tokens if its row is at the pass's
    width; depth_ms if it is deeper than every chosen node) and recomputes the step's time from the
    chosen set. The fast implementation must choose the same nodes."""
    offsets = np.cumsum([0] + [len(t) for t in trees])
    nodes = [(row, i) for row, t in enumerate(trees) for i in range(len(t))]
    parent = [-1 if int(trees[row].parents[i]) < 0 else int(offsets[row]) + int(trees[row].parents[i]) for row, i in nodes]
    values = [float(prices[row].values[i]) for row, i in nodes]
    roots = [k for k in range(len(nodes)) if parent[k] < 0]
    batch = len(roots)
    patience = 11 + batch if patience is None else patience
    priced = cost.num_layers > 0 and all(p.expert_probs is not None for p in prices)
    weights = cost.expert_weights()
    probs = torch.cat([p.expert_probs.double() for p in prices], dim=1).numpy() if priced else None  # [L, N, E]

    depth = [int(trees[row].depths[i]) for row, i in nodes]

    def step_ms(taken):
        width = max(sum(1 for k in taken if nodes[k][0] == row) for row in range(batch))
        padded = subset_verify_ms(cost, sorted(taken), torch.from_numpy(probs) if priced else None, rows=batch)
        deepest = max(depth[k] for k in taken)
        draft = (draft_fixed_ms if deepest else 0.0) + depth_ms * deepest
        return draft + padded + cost.per_token_ms * (batch * width - len(taken))  # padding: tokens, no experts

    chosen, stale = [], 0
    best_rate, best_size = throughput(float(batch), 0.0, step_ms(roots)), 0
    limit = len(nodes) - batch if max_nodes is None else min(max_nodes, len(nodes) - batch)
    while len(chosen) < limit and stale < patience:
        taken = roots + chosen
        sizes = [sum(1 for k in taken if nodes[k][0] == row) for row in range(batch)]
        frontier = [k for k in range(len(nodes)) if k not in taken and parent[k] in taken]
        miss = np.prod(1.0 - probs[:, taken], axis=1) if priced else None  # [L, E]
        experts = {k: float((weights[:, None] * probs[:, k] * miss).sum()) if priced else 0.0 for k in frontier}
        rate = throughput(float(batch) + sum(values[k] for k in chosen), 0.0, step_ms(taken))
        room = {k: sizes[nodes[k][0]] < max(sizes) for k in frontier}
        deepest = max(depth[j] for j in taken)
        deeper = {k: depth_ms * max(depth[k] - deepest, 0) + (draft_fixed_ms if deepest == 0 else 0.0) for k in frontier}
        frontier = [k for k in frontier if not room[k] or values[k] > rate * (experts[k] + deeper[k])]
        if not frontier:
            break
        added = {k: experts[k] + deeper[k] + (0.0 if room[k] else cost.per_token_ms * batch) for k in frontier}
        node = max(frontier, key=lambda k: (values[k] / max(added[k], 1e-9), -k))  # ties to the lower index
        chosen.append(node)
        stale += 1
        rate = throughput(float(batch) + sum(values[k] for k in chosen), 0.0, step_ms(roots + chosen))
        if rate > best_rate + 1e-12:
            best_rate, best_size, stale = rate, len(chosen), 0
    kept = chosen[:best_size]
    return [[0] + [k - int(offsets[row]) for k in kept if nodes[k][0] == row] for row in range(len(trees))]


def _random_forest(rng: np.random.Generator, rows: int, max_nodes: int, layers: int, experts: int, fractional: bool):
    trees, prices = [], []
    for _ in range(rows):
        n = int(rng.integers(1, max_nodes + 1))
        parents = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
        values = torch.ones(n, dtype=torch.float64)
        for i in range(1, n):
            values[i] = values[parents[i]] * rng.uniform(0.05, 0.98)
        if fractional:  # a smoothed predictor: many small probabilities, some exactly zero
            probs = rng.dirichlet(np.full(experts, 0.3), size=(layers, n)) * min(2, experts)
            probs[rng.random(probs.shape) < 0.3] = 0.0
        else:  # top-2 sets
            probs = np.zeros((layers, n, experts))
            for layer in range(layers):
                for node in range(n):
                    probs[layer, node, rng.choice(experts, 2, replace=False)] = 1.0
        trees.append(DraftTree.from_lists(rng.integers(0, 50, n).tolist(), parents))
        prices.append(StepPrices(values, torch.from_numpy(np.clip(probs, 0.0, 1.0))))
    return trees, prices


def test_fast_forest_growth_chooses_what_the_plain_reference_chooses():
    rng = np.random.default_rng(0)
    grew = 0
    for case in range(120):
        layers, experts = int(rng.integers(1, 4)), int(rng.integers(4, 17))
        trees, prices = _random_forest(rng, int(rng.integers(1, 6)), 30, layers, experts, fractional=case % 2 == 1)
        cost = CostModel(base_ms=rng.uniform(2, 20), per_token_ms=rng.uniform(0.02, 0.5),
                         per_expert_ms=tuple(rng.uniform(0.05, 1.0, size=layers)), num_layers=layers,
                         per_row_ms=rng.uniform(0, 3))
        depth_ms, fixed_ms = rng.uniform(0, 3), rng.uniform(0, 3) * (case % 3 == 0)
        expected = reference_best_first_forest(trees, prices, cost, depth_ms, draft_fixed_ms=fixed_ms)
        assert best_first_forest(trees, prices, cost, depth_ms, draft_fixed_ms=fixed_ms) == expected, f"case {case}"
        grew += sum(len(keep) > 1 for keep in expected)
        unpriced = [StepPrices(p.values, None) for p in prices]
        assert best_first_forest(trees, unpriced, cost, depth_ms) == reference_best_first_forest(trees, unpriced, cost, depth_ms)
    assert grew > 100, "the cases must exercise growth, not only root-only answers"


def test_a_dear_row_term_makes_a_batch_speculate_more():
    # verifying extra rows costs time that does not grow with tokens: a larger share of fixed cost
    # per pass makes each drafted token relatively cheaper
    rng = np.random.default_rng(3)
    trees, prices = _random_forest(rng, 4, 20, 2, 8, fractional=False)
    sizes = []
    for per_row_ms in (0.0, 50.0):
        cost = CostModel(base_ms=1.0, per_token_ms=0.4, per_expert_ms=(0.3,), num_layers=2, per_row_ms=per_row_ms)
        sizes.append(sum(len(keep) for keep in best_first_forest(trees, prices, cost, depth_ms=0.5)))
    assert sizes[1] > sizes[0]


def _padded_objective(trees, prices, cost, depth_ms, keeps) -> float:
    """Throughput of verifying each row's `keeps[b]` in one pass padded to the widest row, drafted
    as deep as the deepest row needs."""
    batch, width = len(trees), max(len(k) for k in keeps)
    probs = torch.cat([p.expert_probs[:, k] for p, k in zip(prices, keeps)], dim=1)  # [L, sum |S_b|, E]
    unique = (1.0 - torch.prod(1.0 - probs, dim=1)).sum(-1)
    value = batch + sum(float(p.values[k[1:]].sum()) for p, k in zip(prices, keeps))
    draft_ms = depth_ms * max(int(t.depths[k].max()) for t, k in zip(trees, keeps))
    return throughput(value, draft_ms, cost.predict_ms(batch * width, unique, rows=batch))


def test_batched_growth_is_near_the_brute_force_optimum_of_the_padded_pass():
    rng = random.Random(5)
    worst = 1.0
    for _ in range(40):
        cases = [_random_case(rng, rng.randint(2, 6)) for _ in range(rng.randint(2, 3))]
        trees, prices = [c[0] for c in cases], [c[1] for c in cases]
        cost, depth_ms = cases[0][2], cases[0][3]
        optimum = max(_padded_objective(trees, prices, cost, depth_ms, keeps)
                      for keeps in itertools.product(*[list(_connected_subsets(t)) for t in trees]))
        chosen = best_first_forest(trees, prices, cost, depth_ms)
        achieved = _padded_objective(trees, prices, cost, depth_ms, chosen)
        assert achieved <= optimum + 1e-12
        worst = min(worst, achieved / optimum)
    assert worst >= 0.95, f"batched growth fell to {worst:.3f} of the optimum"


def test_a_wide_batch_makes_one_rows_long_chain_dear():
    # one row drafts a confident chain, the others nothing: each node widens the padded pass by B tokens
    chain = DraftTree.from_lists(list(range(9)), [-1, 0, 1, 2, 3, 4, 5, 6, 7])
    values = torch.tensor([1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2], dtype=torch.float64)
    cost = CostModel(base_ms=10.0, per_token_ms=0.5, per_expert_ms=(0.0,), num_layers=0)
    sizes = []
    for batch in (1, 8):
        trees = [chain] + [DraftTree.root_only(1)] * (batch - 1)
        prices = [StepPrices(values, None)] + [StepPrices(torch.ones(1, dtype=torch.float64), None)] * (batch - 1)
        sizes.append(len(best_first_forest(trees, prices, cost, depth_ms=0.5)[0]))
    assert sizes[1] < sizes[0]


def test_rows_alike_get_trees_alike():
    # free slots next to a wide row cost no tokens, so equal rows grow to equal sizes
    rng = random.Random(2)
    tree, prices, cost, depth_ms = _random_case(rng, 8)
    keeps = best_first_forest([tree] * 4, [prices] * 4, cost, depth_ms)
    assert len({len(k) for k in keeps}) == 1 and len(keeps[0]) > 1


def test_dearer_drafting_verifies_shallower_trees():
    chain = DraftTree.from_lists(list(range(7)), [-1, 0, 1, 2, 3, 4, 5])
    values = torch.tensor([1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4], dtype=torch.float64)
    cost = CostModel(base_ms=10.0, per_token_ms=0.2, per_expert_ms=(0.0,), num_layers=0)
    depths = [len(best_first_subtree(chain, StepPrices(values, None), cost, depth_ms)) - 1 for depth_ms in (0.1, 2.0, 8.0)]
    assert depths[0] > depths[1] > depths[2]


def test_drafted_nodes_are_verified_when_their_value_pays_for_their_verify_time_alone():
    """Drafting that was too dear to size a tree for is spent once the candidates exist: the verify
    choice keeps what pays at the step rate, V - r* t over the growth order, against brute force."""
    chain = DraftTree.from_lists(list(range(6)), [-1, 0, 1, 2, 3, 4])
    values = torch.tensor([1.0, 0.9, 0.8, 0.7, 0.05, 0.04], dtype=torch.float64)
    cost = CostModel(base_ms=10.0, per_token_ms=0.5, per_expert_ms=(0.0,), num_layers=0)
    prices = StepPrices(values, None)
    growth = grow_forest([chain], [prices], cost, depth_ms=20.0)
    assert growth.sized() == [[0]], "at 20 ms a level, drafting does not pay"
    rate = growth.best_rate  # a plain step: 1 token per 10.5 ms
    assert rate == pytest.approx(1 / 10.5)
    verified = growth.verified_when_drafted()[0]
    # brute force over the chain's prefixes: maximise V - rate * t with drafting spent
    best = max(range(6), key=lambda k: (float(values[1:k + 1].sum()) - rate * (10.0 + 0.5 * (k + 1)), -k))
    assert verified == list(range(best + 1))
    assert verified == [0, 1, 2, 3, 4, 5][:len(verified)] and 4 <= len(verified) < 6, \
        "the three likely nodes pay for 0.5 ms each, the unlikely tail does not all pay"
    cheap = grow_forest([chain], [prices], cost, depth_ms=0.01)
    assert cheap.verified_when_drafted() == [sorted(set(cheap.sized()[0]) | set(cheap.verified_when_drafted()[0]))], \
        "what sizing keeps is verified too"


def test_the_growth_records_each_set_it_passed_through():
    rng = random.Random(3)
    tree, prices, cost, depth_ms = _random_case(rng, 7)
    growth = grow_forest([tree], [prices], cost, depth_ms)
    assert len(growth.value) == len(growth.verify_ms) == len(growth.draft_ms) == len(growth.order) + 1
    for size in range(len(growth.order) + 1):
        keep = [0] + sorted(growth.order[:size])
        assert growth.verify_ms[size] == pytest.approx(subset_verify_ms(cost, keep, prices.expert_probs))
        assert growth.value[size] == pytest.approx(1.0 + float(prices.values[keep[1:]].sum()))
    assert growth.sized() == best_first_forest([tree], [prices], cost, depth_ms)


def test_the_growth_in_python_is_the_vectorised_growth():
    """`row_growth` (0/1 expert sets, plain Python) against the vectorised growth, which runs when
    residency is passed (all resident and no fetch cost: the same prices): the same order, the
    same value, verify and draft time after every node, the same best set. One row and several
    (padded passes: free slots and widening), per-layer and shared per-expert prices, with and
    without experts priced, capped and uncapped."""
    from moe_spec.policy.row_growth import flat_expert_sets

    rng = np.random.default_rng(3)
    compared = {1: 0, 2: 0}
    for case in range(300):
        layers, experts = int(rng.integers(1, 5)), int(rng.integers(4, 17))
        rows = 1 if case % 2 else int(rng.integers(2, 7))
        trees, prices = _random_forest(rng, rows, 30 if rows == 1 else 10, layers, experts, fractional=False)
        shared = case % 4 < 2
        cost = CostModel(base_ms=rng.uniform(2, 20), per_token_ms=rng.uniform(0.02, 0.5),
                         per_expert_ms=(rng.uniform(0.05, 1.0),) if shared else tuple(rng.uniform(0.05, 1.0, size=layers)),
                         num_layers=layers, per_row_ms=rng.uniform(0, 3))
        depth_ms, fixed_ms = rng.uniform(0, 3), rng.uniform(0, 3) * (case % 3 == 0)
        price = prices if case % 5 else [StepPrices(p.values, None) for p in prices]
        max_nodes = None if case % 7 else int(rng.integers(1, 8))
        resident = torch.ones(layers, experts, dtype=torch.bool)
        fast = grow_forest(trees, price, cost, depth_ms, max_nodes, draft_fixed_ms=fixed_ms)
        if price[0].expert_probs is not None:  # the routing given as sets instead: the same growth
            as_sets = [StepPrices(p.values, None, flat_expert_sets(p.expert_probs)) for p in price]
            same = grow_forest(trees, as_sets, cost, depth_ms, max_nodes, draft_fixed_ms=fixed_ms)
            assert same.order == fast.order and np.array_equal(same.verify_ms, fast.verify_ms), f"case {case}"
            with pytest.raises(ValueError, match="expert_sets"):  # sets alone cannot price residency
                grow_forest(trees, as_sets, cost, depth_ms, max_nodes, residency=resident)
        vectorised = grow_forest(trees, price, cost, depth_ms, max_nodes, draft_fixed_ms=fixed_ms, residency=resident)
        assert fast.order == vectorised.order and fast.best_size == vectorised.best_size, f"case {case}"
        for field in ("value", "verify_ms", "draft_ms"):
            assert np.allclose(getattr(fast, field), getattr(vectorised, field)), f"case {case}: {field}"
        compared[min(rows, 2)] += len(fast.order) > 2
    assert min(compared.values()) > 100, f"the cases must exercise growth: {compared}"
    sets = flat_expert_sets(torch.tensor([[[0.0, 1.0, 1.0], [1.0, 0.0, 1.0]], [[1.0, 1.0, 0.0], [0.0, 1.0, 1.0]]]))
    assert sets.ids() == [frozenset({1, 2, 3, 4}), frozenset({0, 2, 4, 5})] and sets.num_experts == 3  # layer * E + expert
    assert sets.masks == [0b11110, 0b110101]  # bit x: flat id x
    assert flat_expert_sets(torch.tensor([[[0.5, 1.0, 0.5]]])) is None  # probabilities: the vectorised growth
    assert flat_expert_sets(torch.tensor([[[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]])) is None  # sets of unequal size

