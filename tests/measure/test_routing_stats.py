import numpy as np
import pytest
import torch

from moe_spec.profile.expert_table import evaluate_predictor
from moe_spec.measure.forced_routing import ForcedRouting, feasible, forced_assignment
from moe_spec.measure.routing_stats import RoutingStats, best_first_order, unique_experts_curve, unique_per_layer
from moe_spec.core.acceptance import Acceptance
from moe_spec.core.forest import StepForest
from moe_spec.core.routing import Routing
from moe_spec.core.step_record import StepRecord
from moe_spec.core.routing import RoutingRecorder, find_routers
from moe_spec.core.target import TargetModel
from moe_spec.testing.tiny_models import tiny_model
from moe_spec.core.tree import DraftTree, ancestor_mask


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3_moe", num_hidden_layers=3)


def test_stats_match_hand_counts():
    stats = RoutingStats(vocab_size=10, num_layers=2, num_experts=4, top_k=2)
    tokens = torch.tensor([3, 5, 3])
    experts = torch.tensor([[[0, 1], [1, 2], [0, 3]], [[2, 3], [2, 3], [0, 2]]])  # [L=2, T=3, K=2]
    stats.add(tokens, experts)
    assert stats.load.tolist() == [[2, 2, 1, 1], [1, 0, 3, 2]]
    assert stats.token_totals[3] == 2 and stats.token_totals[5] == 1 and stats.num_tokens == 3
    assert stats.token_counts[3, 0].tolist() == [2, 1, 0, 1]
    assert stats.token_counts[3, 1].tolist() == [1, 0, 2, 1]
    assert stats.coactivation[0, 0, 1] == 1 and stats.coactivation[0, 1, 0] == 1
    assert stats.coactivation[1, 2, 3] == 2 and stats.coactivation[1, 0, 2] == 1
    assert np.array_equal(np.diagonal(stats.coactivation, axis1=1, axis2=2), stats.load)
    assert stats.load_share().sum(axis=1) == pytest.approx([1.0, 1.0])
    assert stats.imbalance().tolist() == pytest.approx([2 / 1.5, 3 / 1.5])
    assert stats.idle_experts().tolist() == [0, 1]


def test_stats_on_a_tiny_model_match_a_loop_over_recorded_routing(model):
    input_ids = torch.randint(0, 96, (1, 24), generator=torch.Generator().manual_seed(0))
    with RoutingRecorder(model) as recorder:
        model(input_ids)
    routing = recorder.routing()  # [L, T, K]
    stats = RoutingStats(96, len(routing.layers), routing.num_experts, routing.experts.shape[-1])
    stats.add(input_ids[0], routing.experts)
    load = np.zeros((len(routing.layers), routing.num_experts), dtype=int)
    per_token: dict[tuple[int, int, int], int] = {}
    for layer in range(len(routing.layers)):
        for t, token in enumerate(input_ids[0].tolist()):
            for expert in routing.experts[layer, t].tolist():
                load[layer, expert] += 1
                per_token[(token, layer, expert)] = per_token.get((token, layer, expert), 0) + 1
    assert np.array_equal(stats.load, load)
    assert stats.load.sum() == 24 * 2 * len(routing.layers)
    for (token, layer, expert), count in per_token.items():
        assert stats.token_counts[token, layer, expert] == count
    assert stats.token_counts.sum() == sum(per_token.values())


def _step(tokens, parents, scores, experts):
    tree = DraftTree.from_lists(tokens, parents, scores)
    return _record(tree, torch.tensor(experts), torch.zeros(len(tokens), dtype=torch.long), [0])


def _record(tree: DraftTree, experts: torch.Tensor, argmax: torch.Tensor, path: list[int], num_experts: int = 8) -> StepRecord:
    """A one-row step record verifying `tree` in full; experts: [L, N, K], argmax: [N]."""
    routing = Routing(tuple(range(experts.shape[0])), num_experts if experts.shape[0] else 0, experts)
    acceptance = Acceptance(list(path), int(argmax[path[-1]]))
    return StepRecord((0,), (0,), (tree,), StepForest((tree,)), (acceptance,), argmax[None], routing, 1.0, 0.1)


def test_unique_curve_uses_best_first_prefixes():
    # scores put node 2 before node 1; layer 0 experts per node: {0,1}, {2,3}, {0,4}
    step = _step([1, 2, 3], [-1, 0, 0], [0.0, -2.0, -1.0], [[[0, 1], [2, 3], [0, 4]]])
    assert best_first_order(step.tree()) == [0, 2, 1]
    pool = torch.tensor([[[0, 1], [0, 1], [0, 1]]])  # every random token uses experts {0, 1}
    curve = unique_experts_curve([step], pool, (1, 2, 3, 4), torch.Generator().manual_seed(0), random_draws=4)
    assert curve.real[:3, 0].tolist() == [2.0, 3.0, 5.0]
    assert np.isnan(curve.real[3, 0]) and curve.real_trees == (1, 1, 1, 0)
    assert curve.random[:, 0].tolist() == [2.0, 2.0, 2.0, 2.0]
    assert unique_per_layer(torch.tensor([[[0, 1], [1, 0]]])).tolist() == [2.0]


def test_forced_assignment_covers_exactly_u_experts():
    generator = torch.Generator().manual_seed(0)
    for tokens, unique in ((1, 2), (4, 8), (16, 5), (3, 6), (64, 8)):
        assignment = forced_assignment(tokens, unique, num_experts=8, top_k=2, generator=generator)
        assert assignment.shape == (tokens, 2)
        assert torch.unique(assignment).numel() == unique
        assert all(torch.unique(row).numel() == 2 for row in assignment)
    assert not feasible(2, 5, 8, 2) and not feasible(4, 1, 8, 2) and not feasible(8, 9, 8, 2)
    with pytest.raises(ValueError):
        forced_assignment(2, 5, 8, 2, generator)


def test_forced_routing_is_seen_by_the_recorder_and_always_removed(model):
    target = TargetModel(model)
    forced = torch.stack([forced_assignment(6, 5, 8, 2, torch.Generator().manual_seed(i)) for i in range(3)])
    tree = DraftTree.from_lists([4, 5, 6, 7, 8, 9], [-1, 0, 0, 1, 1, 2])
    cache = target.new_cache()
    routers = find_routers(model)
    target.forward_tree(target.new_cache(), tree.tokens[None], ancestor_mask(tree)[None], tree.depths[None])
    before = [dict(r.module._forward_hooks) for r in routers]  # transformers' own output-capturing hooks
    with ForcedRouting(model, forced):
        out = target.forward_tree(cache, tree.tokens[None], ancestor_mask(tree)[None], tree.depths[None])
    assert torch.equal(out.routing.experts, forced)
    assert out.routing.unique_per_layer() == [5, 5, 5]
    assert [dict(r.module._forward_hooks) for r in routers] == before
    with pytest.raises(ValueError):
        with ForcedRouting(model, forced):
            model(torch.tensor([[1, 2, 3]]))  # 3 tokens, assignment for 6
    assert [dict(r.module._forward_hooks) for r in routers] == before


def test_token_table_predicts_seen_tokens_and_falls_back_to_the_prior():
    stats = RoutingStats(vocab_size=10, num_layers=1, num_experts=4, top_k=2)
    stats.add(torch.tensor([3, 3, 3, 5]), torch.tensor([[[0, 1], [0, 1], [0, 1], [2, 3]]]))
    table = stats.expert_table(pseudo_count=1.0)
    probs = table.predict_tokens(torch.tensor([3, 7]))  # [L, N, E]
    prior = np.array([3, 3, 1, 1]) / 4
    assert probs[0, 0].tolist() == pytest.approx(((np.array([3, 3, 0, 0]) + prior) / 4).tolist())
    assert probs[0, 1].tolist() == pytest.approx(prior.tolist())
    assert probs.sum(-1).flatten().tolist() == pytest.approx([2.0, 2.0])
    assert table.predict_sets(torch.tensor([3, 5]))[0].sort(-1).values.tolist() == [[0, 1], [2, 3]]
    step = _step([3, 5], [-1, 0], [0.0, -0.1], [[[1, 0], [3, 2]]])
    report = evaluate_predictor(table, [step])
    assert report.node_recall == (1.0,) and report.union_recall == (1.0,) and report.union_precision == (1.0,)
    assert report.node_recall_seen == 1.0 and report.chance_recall == 0.5
