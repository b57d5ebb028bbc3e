"""`TreeDrafter`: EAGLE-2 dynamic draft trees (Li et al., 2024) grown by a feature-reading head, for B
rows at once (one head forward per tree depth for the whole batch); a single sequence is a batch of
one. The head is anything with a runner (`HeadRunner` for an EAGLE-3 head, `EagleDrafter`;
`MtpRunner` for the target's own MTP layers, `MtpDrafter`): the growth, caches, sampling and
pricing below are the same for both.

Cache handling. The head's keys and values live in its runner's preallocated [B, ...]
buffers whose first `lengths[b]` columns are exactly row b's committed pairs (features of
position t, token t+1) whose features came from the target. `begin` writes the prompt's pairs
(their keys and values only, `HeadRunner.write`: no one reads their h), so that the first step
drafts as cheaply as any other; `commit` only queues a step's new pairs (fusing their features);
`propose` runs them through the head in its first forward together with each row's pending pair
(features of its last committed position, root token), whose output gives the root's children
(only that last pair's attention and MLP are computed: the committed pairs' h is never read).
Each further depth is one forward of the frontier nodes chosen for expansion in every row,
written into shared columns past every row's prefix with an ancestor mask, all of row b's at
position C_b + d - 1 for nodes at depth d - 1 (C_b = its committed pairs). Before returning,
`lengths` go back to C: the root pairs and the drafts are simply overwritten by the next writes
(a root pair's token is committed next, by `commit`, and re-queued then).

Tree growth, as EAGLE-2's `topK_genrate`: the root's top-`w` children; at each further depth the
`w` best nodes of the newest depth by cumulative log-probability are expanded, each into its
top-`w` children; after `max_depth` depths every drafted node is reranked globally by cumulative
log-probability and the best `max_nodes` are kept. `w = min(branching, max_nodes)`: with
`branching >= max_nodes` the kept set is the exact top-`max_nodes` of the full `branching`-ary
tree either way (up to exact score ties), so a small budget does proportionally less work. A
child's cumulative log-probability never exceeds its parent's and ties go to the lower (earlier)
index, so the kept set is closed under parents, and a frontier node scoring no better than the
current `max_nodes`-th best drafted node cannot have a descendant in the kept set: such nodes are
not expanded, and growth stops once no row has a frontier node beating its threshold. This
pruning never changes the kept set. When sampling, the draft distribution is the sampled one
(`moe_spec.core.sampling.probabilities`), and candidates it gives zero probability are not drafted.

Sampled candidates (`budget.sampled`, when sampling). Each expanded node's `w` children are drawn
from its draft distribution q without replacement (the Gumbel top-k trick: the `w` largest
log q + Gumbel noise, in draw order), and the tree carries q for verification by recursive
rejection. That is exact only if no draw decides whether it is kept, so the tree grows causally:
a child slot's score is its parent's score plus the log of the i-th *largest* q (a proxy known
before drawing: the slot's value does not depend on what was drawn into it), the slots of a depth
are kept by that proxy before the next depth exists, and nothing kept is dropped later. Depth d
keeps at most half of the node budget still left (the last depth all of it), which gives the
wide-then-narrow shape of EAGLE-2's kept trees; a parent's kept slots are always its first draws.

Rows grow on padded [B, ...] tensors. Where a row has fewer nodes to expand than another (pruned
by its own threshold, candidates of probability zero, or its depth cap), the gap holds
placeholder nodes of score -inf: they run through the head like the others but nothing reads
them, their children are -inf too, and the final rerank drops them. Every row's finite nodes,
their order and their tie breaks are those it has when drafted alone, so each row gets the tree
it would get as a batch of one (up to float rounding of the batched matmuls).
"""


from __future__ import annotations

from collections.abc import Sequence

import torch

from moe_spec.core.drafting import EAGLE2_BUDGET, DraftPricer, TreeBudget
from moe_spec.core.sampling import SamplingConfig, probabilities
from moe_spec.core.target import TargetModel
from moe_spec.core.tree import DraftTree

NEG_INF = float("-inf")


class TreeDrafter:
    """A `moe_spec.core.drafting.BatchDrafter` for any number of rows, over a head's runner.

    A runner has `lengths` (committed columns per row), `reset`, `refresh`, `keep_rows`, `write`,
    `extend`, `draft`, `prefix_mask`, `logits`, `d2t` (draft id -> target id), `draft_vocab`,
    `dtype`, `rows_drafted` and `rows_extended` (see `HeadRunner`), and optionally `start` (each
    row's first token, for a runner that reads tokens alone); `fuse` maps a row's target features
    [A, S, D_t] to the head's input states [A, D]."""

    def __init__(self, runner, fuse, feature_layers: tuple[int, ...], target: TargetModel,
                 budget: TreeBudget | None = None):
        self.feature_layers = tuple(feature_layers)  # the target states this head fuses
        target.feature_layers = self.feature_layers
        self.default_budget = budget or EAGLE2_BUDGET
        self._device = target.model.get_input_embeddings().weight.device
        self._runner = runner
        self._fuse_rows = fuse
        self._queued_g: list[list[torch.Tensor]] = []  # per row, each [A, D] fused target features of queued pairs
        self._queued_tokens: list[list[torch.Tensor]] = []  # per row, each [A] long: the tokens of those pairs
        self._last_g: list[torch.Tensor] | None = None  # per row [1, D] fused features of its last committed position
        self._tables: dict = {}  # per (width, dtype): the constant mask of `_diagonal`

    @property
    def rows_drafted(self) -> int:
        """Tree rows the head has run so far (expanded nodes at depths >= 1 over all rows, placeholders
        included, over all `propose` calls)."""
        return self._runner.rows_drafted

    @property
    def rows_extended(self) -> int:
        """Committed and root pairs the head has taken in so far (a prompt's when decoding begins,
        then each step's), over all calls."""
        return self._runner.rows_extended

    # -- the BatchDrafter protocol -----------------------------------------------------------

    @torch.inference_mode()
    def begin(self, prompts: Sequence[torch.Tensor], features: Sequence[torch.Tensor]) -> None:
        """prompts[b]: [T_b] long; features[b]: [T_b, S, D]. Starts over with len(prompts) rows and
        writes their prompt pairs into the head's cache now, with the target's prefill: the first
        step's drafting then costs what every step's does (with the prompt queued to it, a 16-row
        batch's first draft took 3-4 times a later one's, and the controller's fit of the draft
        time per depth read that as depth)."""
        runner = self._runner
        runner.reset(len(prompts))
        runner.refresh()
        if hasattr(runner, "start"):  # a runner reading tokens alone (a draft model) also takes each row's first
            runner.start([p[:1].to(self._device, torch.long) for p in prompts])
        fused = self._fuse(features)
        runner.write([g[:-1] for g in fused], [p[1:].to(self._device, torch.long) for p in prompts])
        self._queued_g = [[] for _ in fused]
        self._queued_tokens = [[] for _ in fused]
        self._last_g = [g[-1:] for g in fused]

    @torch.inference_mode()
    def commit(self, tokens: Sequence[torch.Tensor], features: Sequence[torch.Tensor]) -> None:
        """tokens[b]: [A_b] long; features[b]: [A_b, S, D]. Row b's pairs (its previous features,
        tokens[b][0]), (features[b][0], tokens[b][1]), ..."""
        fused = self._fuse(features)
        for b, (g, t) in enumerate(zip(fused, tokens)):
            self._queued_g[b].append(torch.cat([self._last_g[b], g[:-1]]))
            self._queued_tokens[b].append(t.to(self._device, torch.long))
        self._last_g = [g[-1:] for g in fused]

    def keep_rows(self, rows: Sequence[int]) -> None:
        rows = list(rows)
        self._runner.keep_rows(rows)
        self._queued_g = [self._queued_g[i] for i in rows]
        self._queued_tokens = [self._queued_tokens[i] for i in rows]
        self._last_g = [self._last_g[i] for i in rows]

    def propose(self, roots: Sequence[int], budget: TreeBudget, max_depths: Sequence[int],
                sampling: SamplingConfig, generator: torch.Generator | None = None) -> list[DraftTree]:
        """Row b's tree rooted at roots[b], at most max_depths[b] deep; `generator` draws sampled
        candidates (`budget.sampled` when sampling)."""
        if self._last_g is None:
            raise RuntimeError(f"{type(self).__name__}.propose called before begin")
        caps = [min(d, budget.max_depth, budget.max_nodes) for d in max_depths]  # each row's depth
        if max(caps) <= 0:
            return [DraftTree.root_only(r) for r in roots]
        width = min(budget.branching, budget.max_nodes, self._runner.draft_vocab)
        with torch.inference_mode():
            runner = self._runner
            runner.refresh()
            # depth 0: each row's queued committed pairs + its root pair, causally, in one forward
            root_ids = torch.tensor(list(roots), device=self._device)
            g = [torch.cat(queued + [last]) for queued, last in zip(self._queued_g, self._last_g)]
            tokens = [torch.cat(queued + [root_ids[b: b + 1]]) for b, queued in enumerate(self._queued_tokens)]
            self._queued_g = [[] for _ in g]
            self._queued_tokens = [[] for _ in g]
            h_root = runner.extend(g, tokens)  # [B, D]
            committed = [n - 1 for n in runner.lengths]  # the root pairs' columns (re-queued by commit)
            draws = Draws(generator) if budget.sampled and not sampling.greedy else None
            try:
                pricer = budget.pricer if draws is None else None  # sampled: the budget alone shapes the tree
                ids, parents, scores, features = self._grow(h_root, committed, caps, width, budget.max_nodes, sampling,
                                                            draws, budget.node_features, pricer)
            finally:
                runner.lengths = committed  # drop the root pairs and the drafts
        # outside inference mode, so the trees hold ordinary tensors
        trees = [rerank(root, runner.d2t, ids[b], parents[b], scores[b], budget.max_nodes,
                        features[b] if features is not None else None)
                 for b, root in enumerate(roots)]
        if draws is None:
            return trees
        return [draws.carried_by(tree, b, ids.shape[1], scores[b], runner.d2t) for b, tree in enumerate(trees)]

    # -- internals -----------------------------------------------------------------------------

    def _fuse(self, features: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Per row [A_b, S, D] -> [A_b, D], in one matmul for the batch."""
        sizes = [f.shape[0] for f in features]
        return list(self._fuse_rows(torch.cat([f.to(self._device) for f in features])).split(sizes))

    def _diagonal(self, width: int) -> torch.Tensor:
        """[w, w] additive tree mask of nodes that see only themselves among their depth, for `_grow`."""
        dtype = self._runner.dtype
        key = (width, dtype)
        if key not in self._tables:
            closed = torch.full((width, width), torch.finfo(dtype).min, dtype=dtype, device=self._device)
            self._tables[key] = closed.fill_diagonal_(0.0)
        return self._tables[key]

    def _grow(self, h_root: torch.Tensor, committed: list[int], caps: list[int], width: int, max_nodes: int,
              sampling: SamplingConfig, draws: "Draws | None" = None, with_features: bool = False,
              pricer: DraftPricer | None = None,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """h_root: [B, D] the root pairs' outputs; committed: each row's committed pairs; caps: each
        row's depth; draws: where sampled candidates are drawn and recorded (None: top tokens);
        pricer: which rows' frontiers are worth one more depth (None: every row's, to its cap).
        Returns [B, N] draft ids, parents and scores of every drafted node (placeholders: score
        -inf), numbered from 1 (the root is 0) depth by depth, each depth in expansion order, and
        with `with_features` [B, N, D] the head output each node was proposed from (its parent's;
        else None)."""
        runner, device = self._runner, h_root.device
        batch = h_root.shape[0]
        diagonal = self._diagonal(width)
        depth_of_row = torch.tensor(caps, device=device)[:, None]  # [B, 1]

        def children(h: torch.Tensor, base: torch.Tensor, nodes: torch.Tensor, depth: int, base_values):
            """h [B, M, D] of expanded nodes `nodes` [B, M] with cumulative scores base [B, M] ->
            their `w` children at `depth`: draft ids, cumulative scores [B, M*w] (-inf stays -inf)
            and, with a pricer, their values [B][M*w] (lists) from the parents' base_values [B][M]."""
            m = h.shape[1]
            log_q = draft_log_probs(runner, h.reshape(batch * m, -1), sampling)  # [B*M, V_draft]
            if draws is None:
                top_logp, top_ids = log_q.topk(width, dim=-1)
            else:
                top_logp, top_ids = draws.draw(log_q, width, nodes)
            cumulative = base[..., None] + top_logp.view(batch, m, width)
            values = None
            if pricer is not None:
                values = pricer.child_values(depth, base_values, top_logp.view(batch, m, width).tolist())
            return top_ids.view(batch, m * width), cumulative.view(batch, m * width), values

        ids, scores, values = children(h_root[:, None], torch.zeros(batch, 1, device=device),
                                       torch.zeros(batch, 1, dtype=torch.long, device=device), 1, [[1.0]] * batch)
        if min(caps) < 1:
            scores = scores.masked_fill(depth_of_row < 1, NEG_INF)
        if draws is not None:
            scores = draws.keep_causally(scores, [], 1, depth_of_row, max_nodes)
        all_ids, all_parents, all_scores = [ids], [torch.zeros_like(ids)], [scores]
        # per depth [B, M*w, D]: each child's parent output, gathered only when asked for
        all_features = [h_root[:, None].expand(-1, width, -1)] if with_features else None
        first = 1  # node index of the newest depth's first node
        h = h_root[:, None]  # [B, M, D] of the rows expanded last: the newest depth's parents
        # [B, M, columns] what the newest depth's nodes see: the root's children see the prefix
        # (each row's committed pairs and root pair), deeper nodes also their ancestors and themselves
        tree_mask = runner.prefix_mask([c + 1 for c in committed])[:, None]
        for depth in range(2, max(caps) + 1):
            ranked, order, live = _frontier(scores, all_scores, first, width, max_nodes, depth_of_row, depth,
                                            sampled=draws is not None, capped=min(caps) < depth)
            frontier_values = worth = None
            if pricer is not None:  # a row stops where nothing one depth deeper could pay
                live, frontier_values, worth = _priced(pricer, depth, values, order, live)
            counts = live.sum(1).tolist()  # live nodes come first in every row; the counts reach Python (loop bounds)
            m = max(counts)
            if m == 0:
                break
            ranked, order = ranked[:, :m], order[:, :m]
            if min(counts) < m:  # rows with fewer live nodes than the widest get placeholders
                ranked = ranked.masked_fill(~live[:, :m], NEG_INF)
            if frontier_values is not None:  # the expanded nodes' values, 0 for placeholders and stopped rows
                frontier_values = [row[:m] if go else [0.0] * m for row, go in zip(frontier_values, worth)]
            # gathers, not advanced indexing: at these sizes the per-call cost is what counts
            parent_slots = (order // width)[..., None]  # [B, m, 1]: row of each expanded node's parent in h
            tree_mask = torch.cat([tree_mask.gather(1, parent_slots.expand(-1, -1, tree_mask.shape[2])),
                                   diagonal[:m, :m].expand(batch, m, m)], dim=2)
            h = runner.draft(h.gather(1, parent_slots.expand(-1, -1, h.shape[2])), runner.d2t[ids.gather(1, order)],
                             [c + depth - 1 for c in committed], tree_mask, depth=depth - 1)
            nodes = order + first  # [B, m] node indices of the expanded
            first += scores.shape[1]
            ids, scores, values = children(h, ranked, nodes, depth, frontier_values)
            if draws is not None:
                scores = draws.keep_causally(scores, all_scores, depth, depth_of_row, max_nodes)
            all_ids.append(ids)
            all_parents.append(nodes[..., None].expand(batch, m, width).reshape(batch, m * width))
            all_scores.append(scores)
            if with_features:
                all_features.append(h.repeat_interleave(width, dim=1))  # [B, m*w, D], children in slot order
        features = torch.cat(all_features, dim=1) if with_features else None
        return torch.cat(all_ids, dim=1), torch.cat(all_parents, dim=1), torch.cat(all_scores, dim=1), features


def _frontier(scores: torch.Tensor, all_scores: list[torch.Tensor], first: int, width: int, max_nodes: int,
              depth_of_row: torch.Tensor, depth: int, sampled: bool, capped: bool,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The newest depth's (scores [B, S], its first node `first`) best `width` nodes to expand at
    `depth`: their ranked scores and slots [B, w], and which are live [B, w] bool: sampled, every
    kept node is final, so the best of the newest depth; top tokens, a node no better than the
    `max_nodes`-th best drafted so far has no kept descendant; `capped`: rows whose depth cap
    (`depth_of_row` [B, 1]) is below `depth` expand nothing."""
    ranked, order = torch.sort(scores, dim=1, descending=True, stable=True)  # ties: lower index first
    ranked, order = ranked[:, :width], order[:, :width]
    if not sampled and first - 1 + scores.shape[1] >= max_nodes:
        drafted = torch.cat(all_scores, dim=1)  # [B, nodes so far]
        threshold = drafted.topk(max_nodes, dim=1).values[:, -1:]  # [B, 1]; -inf with fewer finite nodes
        live = ranked > threshold
    else:
        live = ranked > NEG_INF
    if capped:
        live &= depth_of_row >= depth
    return ranked, order, live


def _priced(pricer: DraftPricer, depth: int, values: list[list[float]], order: torch.Tensor, live: torch.Tensor,
            ) -> tuple[torch.Tensor, list[list[float]], list[bool]]:
    """`live` [B, w] less the rows whose frontier `pricer` says is not worth a depth more, the
    frontier's values [B][w] (0 where not expanded anyway) and each row's verdict [B]."""
    frontier_values = [[row[slot] if alive else 0.0 for slot, alive in zip(slots, alives)]
                       for row, slots, alives in zip(values, order.tolist(), live.tolist())]
    worth = pricer.worth_expanding(depth, frontier_values)
    if not all(worth):
        live = live & torch.tensor(worth, device=live.device)[:, None]
    return live, frontier_values, worth


class Draws:
    """Sampled candidates of one `propose`: drawn without replacement, kept causally, and the
    proposal q of every expanded node recorded for verification."""

    def __init__(self, generator: torch.Generator | None):
        self.generator = generator
        self.nodes: list[torch.Tensor] = []  # per expansion, [B, M] node indices expanded
        self.proposals: list[torch.Tensor] = []  # per expansion, [B, M, V_draft] their q
        self.ranks: list[torch.Tensor] = []  # per expansion, [B, M*w] each child's draw rank

    def draw(self, log_q: torch.Tensor, width: int, nodes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """log_q [B*M, V_draft] -> per expanded node, (log of the i-th largest q, the i-th draw)
        [B*M, w]: the draws in order, the proxy scores known before drawing."""
        uniform = torch.rand(log_q.shape, generator=self.generator).to(log_q.device)
        gumbel = -torch.log(-torch.log(uniform))  # uniform 0 gives -inf: never drawn
        drawn = (log_q + gumbel).topk(width, dim=-1).indices  # [B*M, w] in draw order; q = 0 comes last
        proxy = log_q.topk(width, dim=-1).values  # [B*M, w], -inf exactly where no draw is left
        batch, m = nodes.shape
        self.nodes.append(nodes)
        self.proposals.append(log_q.exp().view(batch, m, -1))
        self.ranks.append(torch.arange(width, device=log_q.device).repeat(batch, m))
        return proxy, drawn

    @staticmethod
    def keep_causally(scores: torch.Tensor, earlier: list[torch.Tensor], depth: int, depth_of_row: torch.Tensor,
                      max_nodes: int) -> torch.Tensor:
        """scores [B, S] proxy scores of the newest depth's slots -> the same with every slot beyond
        this depth's share of the budget set to -inf. `earlier`: the scores of shallower depths
        ([B, *] each, every finite one kept); depth_of_row [B, 1] each row's depth cap."""
        kept_before = sum(((s > NEG_INF).sum(1, keepdim=True) for s in earlier), torch.zeros_like(depth_of_row))
        left = max_nodes - kept_before  # [B, 1]
        share = torch.where(depth_of_row <= depth, left, (left + 1) // 2)  # [B, 1]
        order = torch.sort(scores, dim=1, descending=True, stable=True).indices  # ties: lower index (earlier draw)
        position = torch.empty_like(order).scatter_(1, order, torch.arange(scores.shape[1], device=scores.device).expand_as(order))
        return scores.masked_fill(position >= share, NEG_INF)

    def carried_by(self, tree: DraftTree, row: int, num_drafted: int, scores: torch.Tensor, d2t: torch.Tensor) -> DraftTree:
        """Row `row`'s reranked tree with its proposals and draw ranks. scores: [N] of nodes 1..N as
        grown (the finite ones are exactly the tree's drafted nodes, in node order)."""
        kept = torch.cat([scores.new_zeros(1, dtype=torch.long), (scores > NEG_INF).nonzero().flatten() + 1])  # old indices
        new_index = torch.full((num_drafted + 1,), -1, dtype=torch.long, device=scores.device)
        new_index[kept] = torch.arange(kept.numel(), device=scores.device)
        proposals = torch.zeros(len(tree), self.proposals[0].shape[-1])
        for nodes, q in zip(self.nodes, self.proposals):
            target = new_index[nodes[row]]  # [M]; -1 for placeholders and dropped nodes
            found = target >= 0
            proposals[target[found].cpu()] = q[row][found].float().cpu()
        ranks = torch.cat([r[row] for r in self.ranks])  # [N] of nodes 1..N
        draw_rank = torch.cat([torch.zeros(1, dtype=torch.long), ranks[kept[1:] - 1].cpu()])
        return DraftTree(tree.tokens, tree.parents, tree.scores, proposals, d2t.cpu(), draw_rank, tree.node_features)


def draft_log_probs(runner, h: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """[M, D] -> [M, V_draft] the head's draft log-probabilities (of the sampled distribution when
    sampling)."""
    logits = runner.logits(h).float()
    if sampling.greedy:
        return torch.log_softmax(logits, dim=-1)
    return probabilities(logits, sampling).log()


def rerank(root_token: int, d2t: torch.Tensor, ids: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor,
           max_nodes: int, features: torch.Tensor | None = None) -> DraftTree:
    """The best `max_nodes` drafted nodes of finite score (ties: lower index), in node order, as a
    tree under the root. ids, parents, scores: [N] of nodes 1..N (parents index nodes, 0 the root);
    features: None or [N, D] their parents' head outputs (the tree's `node_features`, root zeros)."""
    best = torch.sort(scores, descending=True, stable=True).indices[:max_nodes]
    best = best[scores[best] > NEG_INF].sort().values  # [K]
    kept = torch.cat([best.new_zeros(1), best + 1])  # node indices, root first, ascending
    new_parents = torch.searchsorted(kept, parents[best])  # closed under parents: every one is found
    # a DraftTree is a host value (the engine, controllers and acceptance read it in Python): moved here
    node_features = None
    if features is not None:
        node_features = torch.cat([features.new_zeros(1, features.shape[1]), features[best]]).float().cpu()
    return DraftTree(
        torch.cat([torch.tensor([root_token]), d2t[ids[best]].cpu()]),
        torch.cat([torch.tensor([-1]), new_parents.cpu()]),
        torch.cat([torch.zeros(1), scores[best].float().cpu()]),
        node_features=node_features,
    )
