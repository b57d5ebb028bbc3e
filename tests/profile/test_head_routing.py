"""The head routing predictor: fitted on some prompts' draft trees, scored on others', kept in the
profile through a validated section, and read by the profiled controllers when the profile keeps it."""

import io
import json
import zipfile
from dataclasses import replace

import numpy as np
import pytest
import torch

from moe_spec.core.drafting import TreeBudget
from moe_spec.core.forest import StepForest
from moe_spec.core.target import TargetModel
from moe_spec.core.tree import DraftTree
from moe_spec.drafters.eagle import EagleDrafter
from moe_spec.measure.decoding import decode_prompts
from moe_spec.measure.head_routing_stage import head_routing_stage, held_out_prompts, node_routing, split_by_prompt
from moe_spec.policy.profiled import ProfiledController
from moe_spec.policy.row_growth import flat_expert_sets
from moe_spec.profile.expert_masks import ids_of_mask
from moe_spec.profile.artifact import Profile, ProfileError, fingerprint, hardware_description
from moe_spec.profile.calibration import AcceptanceCalibration, IsotonicMap
from moe_spec.profile.cost_model import CostModel
from moe_spec.profile.head_routing import RoutingSource
from moe_spec.profile.head_routing_fit import HeadRoutingFit, score_sets
from moe_spec.measure.routing_stats import RoutingStats
from moe_spec.testing.helpers import random_eagle_head
from moe_spec.testing.tiny_models import tiny_model

BUDGET = TreeBudget(12, 3, 4)
QUICK = HeadRoutingFit(context_rank=8, token_rank=4, steps=30)
PROMPTS = 8  # prompts 3 and 7 are held out (no recorded split: every fourth)


@pytest.fixture(scope="module")
def pair():
    target = TargetModel(tiny_model("mixtral", num_hidden_layers=2))
    drafter = EagleDrafter(random_eagle_head(target), target)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 96, (int(n),), generator=g) for n in torch.randint(6, 14, (PROMPTS,), generator=g)]
    return target, drafter, prompts


def _base_profile(target: TargetModel, traces) -> Profile:
    """A profile whose token table is fitted on the decoded text of the prompts that are not held out."""
    stats = RoutingStats(target.vocab_size, len(target.routers), target.num_experts, target.top_k)
    for trace in traces:
        if trace.prompt_index % 4 != 3:
            stats.add(trace.tokens, trace.experts)
    iso = IsotonicMap((0.1, 0.5, 0.9), (0.2, 0.5, 0.8), 100)
    return Profile(fingerprint(target), hardware_description(), CostModel(3.0, 0.1, (0.05, 0.05), num_layers=2),
                   AcceptanceCalibration((iso, iso), (iso, iso), 2), stats.expert_table(), "topk")


@pytest.fixture(scope="module")
def fitted(pair):
    target, drafter, prompts = pair
    traces = decode_prompts(target, drafter, prompts, 8, BUDGET.with_node_features(True))
    profile = head_routing_stage(target, drafter, prompts, _base_profile(target, traces), max_new_tokens=8,
                                 budget=BUDGET, settings=QUICK)
    return profile, node_routing(traces)


def test_the_split_is_by_prompt_and_the_scores_are_the_held_out_ones(fitted):
    profile, nodes = fitted
    report = profile.head_routing.report
    assert report["held_out_prompts"] == [3, 7] and report["fit_prompts"] == [0, 1, 2, 4, 5, 6]
    fit, held = split_by_prompt(nodes, frozenset(report["held_out_prompts"]))
    assert set(fit.prompt.tolist()).isdisjoint(held.prompt.tolist())
    assert set(held.prompt.tolist()) == {3, 7} and len(fit) + len(held) == len(nodes)
    assert report["fit_nodes"] == int((fit.depths > 0).sum())
    table = profile.expert_table
    token = score_sets(table.predict_sets(held.tokens), held, table.num_experts)
    assert report["held_out"]["token_table"] == token.to_dict()  # scored on the held-out trees, not the fitted ones
    assert report["held_out"]["head"]["nodes"] == int((held.depths > 0).sum())
    assert report["held_out"]["head"]["trees"] == token.trees == len(set(held.tree.tolist()))
    f1 = report["held_out"]
    assert profile.head_routing.keeps is (RoutingSource.HEAD if f1["head"]["union_f1"] > f1["token_table"]["union_f1"]
                                          else RoutingSource.TOKEN_TABLE)


def test_the_recorded_split_of_the_profile_is_used():
    profile = replace(Profile.load("moe_spec/assets/default_profile.json"))
    assert held_out_prompts(profile, 24) == frozenset({3, 7, 11, 15, 19, 23})
    with pytest.raises(ValueError, match="proper, non-empty subset"):
        held_out_prompts(profile, 20)  # prompt 23 does not exist: not the profile's prompts


def test_the_nodes_carry_the_verify_passes_routing(pair, fitted):
    _, nodes = fitted
    assert nodes.features.shape[1] == pair[0].model.config.hidden_size
    assert torch.count_nonzero(nodes.features[nodes.depths == 0]) == 0
    assert bool((nodes.features[nodes.depths > 0].abs().sum(1) > 0).all())
    assert nodes.experts.shape[0] == 2 and bool((nodes.experts < pair[0].num_experts).all())


def test_the_predictor_round_trips_through_the_profile(tmp_path, pair, fitted):
    profile, nodes = fitted
    profile.save(tmp_path / "p.json")
    loaded = Profile.load(tmp_path / "p.json", pair[0])
    assert loaded.head_routing.keeps is profile.head_routing.keeps
    assert loaded.head_routing.report == json.loads(json.dumps(profile.head_routing.report))
    saved, read = profile.head_routing.predictor.arrays(), loaded.head_routing.predictor.arrays()
    assert saved.keys() == read.keys() and all(np.array_equal(saved[k], read[k]) for k in saved)
    assert not any(k.startswith("head_routing_") for k in loaded.arrays)
    args = (nodes.features, nodes.tokens, nodes.depths)
    assert torch.equal(profile.head_routing.predictor.predict_onehot(*args, profile.expert_table),
                       loaded.head_routing.predictor.predict_onehot(*args, loaded.expert_table))


def _rewrite(path, document: dict, arrays: dict) -> None:
    """Write `document` and a sidecar of `arrays`, the checksum updated."""
    import hashlib

    buffer = io.BytesIO()
    np.savez_compressed(buffer, **arrays)
    path.with_suffix(".npz").write_bytes(buffer.getvalue())
    document["arrays"]["sha256"] = hashlib.sha256(buffer.getvalue()).hexdigest()
    path.write_text(json.dumps(document))


@pytest.mark.parametrize("edit, message", [
    (lambda doc, arrays: doc["head_routing"].update(kind="mlp_v9"), "unknown head routing predictor kind 'mlp_v9'"),
    (lambda doc, arrays: doc["head_routing"].update(keeps="oracle"), "keeps must be 'head' or 'token_table'"),
    (lambda doc, arrays: arrays.pop("head_routing_bias"), "lacks head_routing_bias"),
    (lambda doc, arrays: arrays.update(head_routing_token_vectors=np.zeros((50, 4), np.float32)),
     "'head_routing_token_vectors' has shape \\(50, 4\\)"),
    (lambda doc, arrays: arrays.update(head_routing_token_weight=np.zeros((5, 16), np.float32)),
     "shapes disagree"),
    (lambda doc, arrays: arrays.update(
        head_routing_context_projection=np.zeros((doc["fingerprint"]["hidden_size"], 2000), np.float32)),
     "a rank \\('R'\\) must be 1..1024"),
    (lambda doc, arrays: arrays.update(head_routing_table_scale=np.array([np.nan, 1.0], np.float32)), "finite"),
    (lambda doc, arrays: arrays.update(head_routing_bias=np.array(["x"] * 16)), "not numbers"),
])
def test_a_corrupt_or_foreign_head_routing_section_is_refused(tmp_path, fitted, edit, message):
    profile, _ = fitted
    path = tmp_path / "p.json"
    profile.save(path)
    document = json.loads(path.read_text())
    arrays = {**profile.expert_table.arrays(), **profile.head_routing.predictor.arrays()}
    edit(document, arrays)
    _rewrite(path, document, arrays)
    with pytest.raises(ProfileError, match=message):
        Profile.load(path)


def test_the_sidecar_is_read_without_unpickling(tmp_path, fitted):
    profile, _ = fitted
    profile.save(tmp_path / "p.json")
    with zipfile.ZipFile(tmp_path / "p.npz") as archive:
        assert {"head_routing_context_weight.npy", "head_routing_token_vectors.npy"} <= set(archive.namelist())


def _tree_with_features(nodes, tree: int) -> DraftTree:
    keep = nodes.tree == tree
    parents = torch.tensor([-1] + list(range(int(keep.sum()) - 1)))  # any valid tree: pricing reads no parents
    return DraftTree(nodes.tokens[keep], parents, torch.zeros(int(keep.sum())), node_features=nodes.features[keep])


@pytest.mark.parametrize("keeps", [RoutingSource.HEAD, RoutingSource.TOKEN_TABLE])
def test_the_controller_prices_by_the_predictor_the_profile_keeps(fitted, keeps):
    profile, nodes = fitted
    profile = replace(profile, head_routing=replace(profile.head_routing, keeps=keeps))
    controller = ProfiledController(profile)
    budget = controller.begin(BUDGET)
    assert budget.node_features is (keeps is RoutingSource.HEAD)
    trees = (_tree_with_features(nodes, 0), DraftTree.root_only(5), _tree_with_features(nodes, 1))
    forest = StepForest(trees)
    priced = controller._expert_probs(forest)  # [L, N, E]
    table = profile.priced_experts(forest.tokens)
    one_row = StepForest(trees[:1])  # the plan's id sets (one row) are the same routing
    assert controller._expert_sets(one_row) == flat_expert_sets(controller._expert_probs(one_row))
    if keeps is RoutingSource.TOKEN_TABLE:
        assert torch.equal(priced, table)
        return
    features = torch.cat([trees[0].node_features, torch.zeros(1, nodes.features.shape[1]), trees[2].node_features])
    head = profile.head_routing.predictor.predict_onehot(features, forest.tokens, torch.from_numpy(forest.depths),
                                                         profile.expert_table)
    assert torch.equal(priced, head) and not torch.equal(priced, table)
    roots = torch.from_numpy(forest.depths == 0)
    assert torch.equal(priced[:, roots], table[:, roots])  # roots have no parent output: the table prices them
    without = StepForest((replace(trees[0], node_features=None), trees[2]))
    assert torch.equal(controller._expert_probs(without), profile.priced_experts(without.tokens))


def test_the_predicted_sets_are_the_k_largest_logits_and_roots_the_tables(fitted):
    """`predict_onehot` (numpy, on the controller's critical path) against its definition in torch."""
    profile, nodes = fitted
    predictor, table = profile.head_routing.predictor, profile.expert_table
    features, tokens = nodes.features, nodes.tokens
    depths = torch.arange(len(tokens)) % 3  # every third node a root
    onehot = predictor.predict_onehot(features, tokens, depths, table)  # [L, N, E]
    logits = predictor.logits(features, tokens, table)
    expected = torch.zeros_like(logits).scatter_(2, logits.topk(predictor.top_k, dim=-1).indices, 1.0)
    roots = depths == 0
    expected[:, roots] = table.predict_onehot_tokens(tokens[roots])
    assert torch.equal(onehot, expected)
    assert torch.equal(onehot.sum(-1), torch.full(onehot.shape[:2], float(predictor.top_k)))
    flat = predictor.predict_flat_ids(features, tokens, depths, table)  # [N, L*K]
    assert flat_expert_sets(expected).ids() == [frozenset(row) for row in flat.tolist()]
    assert [frozenset(row) for row in table.flat_ids_by_token[tokens[roots].numpy()].tolist()] == \
        flat_expert_sets(table.predict_onehot_tokens(tokens[roots])).ids()
    assert [table.flat_id_mask(token) for token in tokens[roots].tolist()] == \
        flat_expert_sets(table.predict_onehot_tokens(tokens[roots])).masks
    with pytest.raises(ValueError, match="token must be an id"):
        table.flat_id_mask(table.vocab_size)
    drafted = (depths != 0).nonzero().flatten().tolist()
    masks = predictor.predict_drafted_masks(features, tokens, table)  # the controller's form: drafted nodes' rows
    assert [ids_of_mask(masks[node]) for node in drafted] == [frozenset(flat[node].tolist()) for node in drafted]


def test_features_of_the_wrong_width_are_named(fitted):
    profile, nodes = fitted
    predictor = profile.head_routing.predictor
    with pytest.raises(ValueError, match="features must be"):
        predictor.predict_sets(nodes.features[:, :3], nodes.tokens, profile.expert_table)
