"""Choosing which drafted nodes to verify: the economics of one speculative step, as pure functions.

A step verifies a connected subtree S of the candidate tree (root always included) and
produces on average 1 + sum_{i in S, i != root} v_i tokens, where v_i is the calibrated
probability that node i lies on the accepted path (the 1 is the bonus token). It costs the
draft time of the depth S reaches, d(S) = depth_ms * depth(S), plus the verify time

    t(S) = base_ms + per_row_ms * (B - 1) + per_token_ms * T + sum_l per_expert_ms[l] * U_l(S),

U_l(S) = sum_e 1 - prod_{i in S} (1 - p_{l,i,e}) being the expected number of distinct experts
layer l loads for S (p: predicted routing probabilities), B the rows verified in the pass (1 for
one sequence; a batch's B rows share one pass, one t and one set of loaded experts) and T the
tokens the pass computes (B times the widest row: rows are padded). The controller maximises the
step's throughput (B + V(S)) / (d(S) + t(S)).

The draft time is priced by the depth S needs rather than taken as the (already spent) time of
drafting the candidates: maximising a ratio with a sunk cost in the denominator favours larger
trees the larger the sunk cost, so a generous candidate tree would talk the controller into
verifying more of it, and the next candidate tree, sized from what was verified, would grow again.

Adding node j raises the value by v_j and the time by the experts it adds that S does not load
yet, sum_l per_expert_ms[l] * sum_e p_{l,j,e} * prod_{i in S} (1 - p_{l,i,e}), plus B tokens if
it widens the pass and depth_ms if it is deeper than S. `best_first_forest` grows S from the
roots, each time adding the frontier node with the best marginal value per marginal millisecond,
over the whole trees at once (no per-depth top-k), and returns the best set seen along the way;
unlike stopping at the first node that does not pay, this also finds sets where a node only pays
together with its children.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from moe_spec.profile.cost_model import CostModel
from moe_spec.core.tree import DraftTree


@dataclass(frozen=True)
class StepPrices:
    """What the controller knows about one candidate tree."""

    values: torch.Tensor  # [N] float: calibrated P(node on the accepted path); root's entry is ignored
    expert_probs: torch.Tensor | None  # [L, N, E] predicted routing probabilities; None: dense or not priced


def throughput(value: float, draft_ms: float, verify_ms: float) -> float:
    """Expected tokens per ms of a step producing `value` tokens on average."""
    return value / max(draft_ms + verify_ms, 1e-9)


def subset_verify_ms(cost: CostModel, keep: list[int], expert_probs: torch.Tensor | None, rows: int = 1) -> float:
    """t(S) for node indices `keep` (every row's root included) of a pass over `rows` rows; with
    several rows, `keep` and expert_probs' N index the rows' nodes side by side."""
    if expert_probs is None or cost.num_layers == 0:
        return cost.fixed_ms(rows) + cost.per_token_ms * len(keep)
    probs = expert_probs[:, keep].double()  # [L, |S|, E]
    unique = (1.0 - torch.prod(1.0 - probs, dim=1)).sum(-1)  # [L]
    return cost.predict_ms(len(keep), unique, rows)


def subset_objective(cost: CostModel, tree: DraftTree, prices: StepPrices, keep: list[int], depth_ms: float = 0.0) -> float:
    """Throughput of verifying `keep` of one tree, drafted to the depth it reaches."""
    value = 1.0 + float(prices.values[[k for k in keep if k != 0]].sum()) if len(keep) > 1 else 1.0
    draft_ms = depth_ms * int(tree.depths[keep].max())
    return throughput(value, draft_ms, subset_verify_ms(cost, keep, prices.expert_probs))


def best_first_subtree(tree: DraftTree, prices: StepPrices, cost: CostModel, depth_ms: float = 0.0,
                       max_nodes: int | None = None) -> list[int]:
    """Node indices (root first) of the subtree chosen by best-first growth; see module docstring."""
    return best_first_forest([tree], [prices], cost, depth_ms, max_nodes)[0]


def best_first_forest(
    trees: list[DraftTree],
    prices: list[StepPrices],
    cost: CostModel,
    depth_ms: float,
    max_nodes: int | None = None,
    patience: int | None = None,
    draft_fixed_ms: float = 0.0,
) -> list[list[int]]:
    """Best-first growth over the B rows' trees verified in one pass (B = 1: one sequence). Every
    row's root is mandatory, all rows share one verify time, and a node's expert price counts only
    experts that no chosen node of *any* row loads yet. Returns each row's chosen node indices, root first.

    The pass is padded (`batch_layout.step_inputs`): it computes B * W tokens, W the widest row's
    size, and padding loads no expert. So a node in a row narrower than W fills a slot the pass
    computes anyway and costs only the experts it adds, while a node in a row at width W widens the
    pass by B tokens. A node deeper than every chosen node also costs the draft time of that depth
    (`depth_ms`, drafting all rows one level deeper): the time a step spends on drafting is priced
    by the depth the chosen trees need (plus `draft_fixed_ms` once any node is chosen), never taken
    as already spent, so a large candidate tree does
    not talk the controller into verifying more of it. Growth adds the frontier node of best value
    per marginal millisecond under these prices (free-slot nodes only while they raise the
    throughput by themselves), and returns the
    best set seen along the way; growth stops `patience` nodes after the last improvement (default
    11 + B, so a new width can be filled across the rows). With one row every node widens the pass,
    which is plain best-first growth by marginal value per marginal time.

    Runs in numpy, on the critical path of every decoding step. Each node's expert price is kept
    and updated as nodes are chosen: a chosen node lowers the chance that an expert is still
    unloaded only for the (layer, expert) entries it may load (K per layer with top-K predictions),
    so only those columns are subtracted, instead of re-pricing every node against every expert.
    """
    offsets = np.cumsum([0] + [len(t) for t in trees])
    n, batch = int(offsets[-1]), len(trees)
    parents = np.concatenate([np.where(t.parents.numpy() >= 0, t.parents.numpy() + o, -1) for t, o in zip(trees, offsets)])
    values = np.concatenate([p.values.double().numpy() for p in prices])  # [N]
    depths = np.concatenate([t.depths.numpy() for t in trees])  # [N]
    is_root = parents < 0
    row_of = np.repeat(np.arange(batch), np.diff(offsets))  # [N]
    priced = cost.num_layers > 0 and all(p.expert_probs is not None for p in prices)
    expert_ms = np.zeros(n)  # [N]: ms of the experts each node would newly load
    if priced:
        row_probs = [p.expert_probs.double().numpy() for p in prices]  # each [L, N_b, E]
        num_layers, _, num_experts = row_probs[0].shape
        by_expert = np.concatenate([r.transpose(0, 2, 1) for r in row_probs], axis=2).reshape(-1, n)  # [L*E, N]
        per_expert = np.repeat(np.asarray(cost.expert_weights(), dtype=np.float64), num_experts)  # [L*E] ms if new
        miss = np.prod([1.0 - r[:, 0] for r in row_probs], axis=0).reshape(-1)  # [L*E]: chance no chosen node loads it yet
        expert_ms += (miss * per_expert) @ by_expert
        verify = cost.predict_ms(batch, (1.0 - miss).reshape(num_layers, num_experts).sum(-1), rows=batch)
    else:
        verify = cost.fixed_ms(batch) + cost.per_token_ms * batch
    value = float(batch)  # every row's bonus token
    limit = n - batch if max_nodes is None else min(max_nodes, n - batch)
    patience = 11 + batch if patience is None else patience
    sizes, width = np.ones(batch, dtype=np.int64), 1  # nodes per row (root included); the pass's width
    chosen: list[int] = []
    deepest, draft_ms = 0, 0.0  # depth of the chosen nodes, and the draft time that depth needs
    best_rate, best_size = throughput(value, draft_ms, verify), 0
    stale = 0  # changes since the best set
    in_frontier = np.zeros(n, dtype=bool)
    in_frontier[~is_root] = is_root[parents[~is_root]]
    children = [[] for _ in range(n)]
    for node in np.flatnonzero(~is_root):
        children[parents[node]].append(node)
    while len(chosen) < limit and stale < patience:
        frontier = np.flatnonzero(in_frontier)
        room = sizes[row_of[frontier]] < width  # the node fills a slot the pass computes anyway
        deeper_ms = depth_ms * np.maximum(depths[frontier] - deepest, 0)  # drafting one more depth
        if deepest == 0:
            deeper_ms = deeper_ms + draft_fixed_ms  # the first drafted node pays for drafting at all
        # a free slot's node is only worth it if it raises the throughput by itself
        eligible = ~room | (values[frontier] > throughput(value, draft_ms, verify) * (expert_ms[frontier] + deeper_ms))
        if not eligible.any():
            break
        frontier, room, deeper_ms = frontier[eligible], room[eligible], deeper_ms[eligible]
        slot_ms = np.where(room, 0.0, cost.per_token_ms * batch)  # widening the pass: B more tokens
        pick = int(np.argmax(values[frontier] / np.maximum(expert_ms[frontier] + slot_ms + deeper_ms, 1e-9)))
        node = int(frontier[pick])
        if not room[pick]:
            width += 1
            verify += cost.per_token_ms * batch
        deepest = max(deepest, int(depths[node]))
        draft_ms = draft_fixed_ms + depth_ms * deepest
        chosen.append(node)
        value += values[node]
        verify += expert_ms[node]
        sizes[row_of[node]] += 1
        if priced:
            row = int(row_of[node])
            loads = row_probs[row][:, node - offsets[row]].reshape(-1)  # [L*E]: P(node loads expert e of layer l)
            touched = np.flatnonzero(loads * miss)  # [M]: the entries whose miss changes (not yet surely loaded)
            kept = miss[touched] * (1.0 - loads[touched])
            expert_ms -= ((miss[touched] - kept) * per_expert[touched]) @ by_expert[touched]  # their price drops
            miss[touched] = kept
        in_frontier[node] = False
        in_frontier[children[node]] = True
        stale += 1
        rate = throughput(value, draft_ms, verify)
        if rate > best_rate:
            best_rate, best_size, stale = rate, len(chosen), 0
    kept_nodes = chosen[:best_size]
    return [
        [0] + [k - int(offsets[row]) for k in kept_nodes if offsets[row] <= k < offsets[row + 1]]
        for row in range(len(trees))
    ]


def best_prefix_by_score(tree: DraftTree, values: torch.Tensor, verify_ms_for_tokens, draft_ms: float) -> list[int]:
    """The EVICT-style cut: order drafted nodes by draft score (EAGLE-2's rerank), keep the prefix
    with the highest expected tokens per ms under a cost that depends on the token count only.

    verify_ms_for_tokens: callable T -> ms for a verify pass of T tokens (root included).
    """
    scores = tree.scores[1:].numpy()
    order = np.lexsort((np.arange(1, len(tree)), -scores)) + 1  # by score, ties to the lower index
    expected = 1.0 + np.concatenate([[0.0], np.cumsum(values.double().numpy()[order])])  # [N]: prefix of size k
    verify = np.array([verify_ms_for_tokens(size + 1) for size in range(len(tree))])
    best = int(np.argmax(expected / np.maximum(draft_ms + verify, 1e-9)))  # first maximum: the smaller prefix
    return [0] + order[:best].tolist()
