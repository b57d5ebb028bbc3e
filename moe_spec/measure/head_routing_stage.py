"""The profiler stage for the head routing predictor: record, fit, score against the table, keep the better.

    profile = head_routing_stage(target, drafter, prompts, profile)

1. Decode every prompt through `SpecDecoder` with EAGLE-2's 60-node trees, asking the drafter for
   node features (`TreeBudget.node_features`), and keep every verified node with its parent head
   output and the routing the verify pass recorded for it. These are real draft trees: a node at
   depth >= 2 is proposed from the head's own output, not the target's features, exactly as at
   decode time (pairs built from the target's features at committed positions would only match
   depth 1).
2. Split by prompt: the prompts the profile held out when it fitted its token table
   (`details.measurement.held_out_prompts`, else every fourth) are held out here too, so neither
   predictor has seen them.
3. Fit the predictor on the other prompts' drafted nodes (`fit_head_routing`), blended with the
   profile's token table.
4. Score both on the held-out trees (`score_sets`); the profile keeps the head predictor when its
   predicted expert unions match the actual ones better (union F1, mean over layers).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace

import torch

from moe_spec.core.drafting import EAGLE2_BUDGET, TreeBudget
from moe_spec.measure.decoding import PromptTrace, decode_prompts
from moe_spec.profile.head_routing import HeadRouting, NodeRouting, RoutingSource
from moe_spec.profile.head_routing_fit import HeadRoutingFit, fit_head_routing, score_sets

HELD_OUT_EVERY = 4  # the profiler's default split (`ProfileSettings.heldout_every`)


def node_routing(traces: Sequence[PromptTrace]) -> NodeRouting:
    """Every verified tree of `traces` that carries node features, its nodes with their routing."""
    features, tokens, depths, experts, tree, prompt = [], [], [], [], [], []
    for trace in traces:
        for step in trace.steps:
            verified = step.tree()
            if verified.node_features is None:  # a step that drafted nothing (root alone)
                continue
            n = len(verified)
            features.append(verified.node_features.float())
            tokens.append(verified.tokens)
            depths.append(verified.depths)
            experts.append(step.experts())
            tree.append(torch.full((n,), len(tree), dtype=torch.long))
            prompt.append(torch.full((n,), trace.prompt_index, dtype=torch.long))
    if not tokens:
        raise ValueError("no decoded step drafted a tree with node features (is the drafter an EagleDrafter?)")
    return NodeRouting(torch.cat(features), torch.cat(tokens), torch.cat(depths), torch.cat(experts, dim=1),
                       torch.cat(tree), torch.cat(prompt))


def held_out_prompts(profile, num_prompts: int) -> frozenset[int]:
    """The prompts the profile's token table was not fitted on (its recorded split), else every fourth."""
    recorded = (profile.details.get("measurement") or {}).get("held_out_prompts")
    if recorded is not None:
        held = frozenset(int(i) for i in recorded)
    else:
        held = frozenset(i for i in range(num_prompts) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1)
    if not held or not held < frozenset(range(num_prompts)):
        raise ValueError(f"held-out prompts {sorted(held)} must be a proper, non-empty subset of the "
                         f"{num_prompts} prompts (were these the profile's prompts?)")
    return held


def split_by_prompt(nodes: NodeRouting, held_out: frozenset[int]) -> tuple[NodeRouting, NodeRouting]:
    """(fit, held-out) nodes: whole prompts on either side, never one prompt in both."""
    held = torch.isin(nodes.prompt, torch.tensor(sorted(held_out), dtype=torch.long))
    fit, evaluation = nodes.where(~held), nodes.where(held)
    if not len(fit) or not len(evaluation):
        raise ValueError(f"held-out prompts {sorted(held_out)} leave no nodes on one side of the split")
    return fit, evaluation


def head_routing_stage(target, drafter, prompts: Sequence[torch.Tensor], profile, max_new_tokens: int = 48,
                       budget: TreeBudget = EAGLE2_BUDGET, settings: HeadRoutingFit = HeadRoutingFit(),
                       tick: Callable[[], None] = lambda: None):
    """`profile` with its `head_routing` section: the predictor fitted on the fit prompts' trees, both
    predictors' held-out scores, and which one the profile keeps."""
    table = profile.expert_table
    if table is None:
        raise ValueError("the profile has no token expert table (dense target?): nothing to predict routing for")
    start = time.perf_counter()
    traces = decode_prompts(target, drafter, prompts, max_new_tokens, budget.with_node_features(True), tick)
    decoded_s = time.perf_counter() - start
    held_out = held_out_prompts(profile, len(prompts))
    fit_nodes, eval_nodes = split_by_prompt(node_routing(traces), held_out)
    start = time.perf_counter()
    predictor = fit_head_routing(fit_nodes, target.model.get_input_embeddings().weight, table, settings)
    fit_s = time.perf_counter() - start
    head = score_sets(_head_sets(predictor, eval_nodes, table), eval_nodes, table.num_experts)
    token = score_sets(table.predict_sets(eval_nodes.tokens), eval_nodes, table.num_experts)
    keeps = RoutingSource.HEAD if head.union_f1 > token.union_f1 else RoutingSource.TOKEN_TABLE
    report = {
        "held_out": {"head": head.to_dict(), "token_table": token.to_dict()},
        "chosen_by": "union_f1 on held-out trees (mean over layers)",
        "held_out_prompts": sorted(held_out),
        "fit_prompts": sorted(set(range(len(prompts))) - held_out),
        "fit_nodes": len(fit_nodes.where(fit_nodes.depths > 0)),
        "budget": asdict(budget.with_node_features(True)),
        "max_new_tokens": max_new_tokens,
        "settings": asdict(settings),
        "decode_seconds": decoded_s,
        "fit_seconds": fit_s,
    }
    return replace(profile, head_routing=HeadRouting(predictor, keeps, report))


def _head_sets(predictor, nodes: NodeRouting, table) -> torch.Tensor:
    """[L, N, K] the head predictor's sets as a controller prices them: roots by the table."""
    sets = predictor.predict_sets(nodes.features, nodes.tokens, table)
    roots = nodes.depths == 0
    sets[:, roots] = table.predict_sets(nodes.tokens[roots])
    return sets
