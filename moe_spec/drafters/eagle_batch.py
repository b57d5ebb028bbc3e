"""`EagleBatchDrafter`: EAGLE-2 dynamic trees for B rows, grown together (one head forward per depth).

The tree growth is `EagleDrafter`'s (see `moe_spec.drafters.eagle`), run on padded [B, ...] tensors:
each depth expands up to `w` nodes per row in one `BatchHeadRunner.draft` for the whole batch.
Where a row has fewer nodes to expand than another (pruned by its own `max_nodes`-th best score,
candidates of probability zero when sampling, or its depth cap), the gap holds placeholder nodes of
score -inf: they run through the head like the others but nothing reads them, their children are
-inf too, and the final rerank drops them. Every row's finite nodes, their order and their tie
breaks are those of its own single-row growth, so each row gets the tree `EagleDrafter` would give
it (up to float rounding of the batched matmuls).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moe_spec.core.drafting import TreeBudget
from moe_spec.drafters.batch_head_runner import BatchHeadRunner
from moe_spec.drafters.eagle_head import EagleHead, check_fits
from moe_spec.core.sampling import SamplingConfig, probabilities
from moe_spec.core.target import TargetModel
from moe_spec.core.tree import DraftTree

NEG_INF = float("-inf")


class EagleBatchDrafter:
    def __init__(self, head: EagleHead, target: TargetModel, batch: int, budget: TreeBudget | None = None):
        check_fits(head.config, target)
        self.head = head.eval()
        self.embed = target.model.get_input_embeddings()
        self.default_budget = budget or TreeBudget(max_nodes=60, max_depth=5, branching=10)
        self._device = self.embed.weight.device
        self.head.to(self._device)
        self._runner = BatchHeadRunner(self.head, self.embed, batch)
        self._last_g: torch.Tensor | None = None  # [B, D] fused features of each row's last committed position

    @property
    def rows_drafted(self) -> int:
        return self._runner.rows_drafted

    # -- the BatchDrafter protocol -----------------------------------------------------------

    # Committed pairs go into the head's cache right away (`append`: keys and values only), so a
    # proposal runs just the root pairs and the tree depths.

    @torch.inference_mode()
    def begin(self, prompts: Sequence[torch.Tensor], features: Sequence[torch.Tensor]) -> None:
        """prompts[b]: [T_b] long; features[b]: [T_b, S, D]."""
        self._runner.reset(len(prompts))
        self._runner.refresh()
        fused = self._fuse(features)
        self._runner.append([g[:-1] for g in fused], [p[1:].to(self._device) for p in prompts])
        self._last_g = torch.cat([g[-1:] for g in fused])

    @torch.inference_mode()
    def commit(self, tokens: Sequence[torch.Tensor], features: Sequence[torch.Tensor]) -> None:
        """Row b's pairs (its previous features, tokens[b][0]), (features[b][0], tokens[b][1]), ..."""
        self._runner.refresh()
        fused = self._fuse(features)
        self._runner.append([torch.cat([self._last_g[b: b + 1], g[:-1]]) for b, g in enumerate(fused)],
                            [t.to(self._device, torch.long) for t in tokens])
        self._last_g = torch.cat([g[-1:] for g in fused])

    def keep_rows(self, rows: Sequence[int]) -> None:
        index = torch.as_tensor(list(rows), dtype=torch.long)
        self._runner.keep_rows(index)
        self._last_g = self._last_g[index.to(self._device)]

    def propose(self, roots: Sequence[int], budget: TreeBudget, max_depths: Sequence[int],
                sampling: SamplingConfig) -> list[DraftTree]:
        if self._last_g is None:
            raise RuntimeError("EagleBatchDrafter.propose called before begin")
        caps = torch.tensor([min(d, budget.max_depth, budget.max_nodes) for d in max_depths])  # [B]
        if int(caps.max()) <= 0:
            return [DraftTree.root_only(r) for r in roots]
        width = min(budget.branching, budget.max_nodes, self.head.config.draft_vocab_size)
        with torch.inference_mode():
            runner = self._runner
            runner.refresh()
            h_root = runner.extend(self._last_g, torch.tensor(list(roots), device=self._device))  # [B, D]: root pairs
            committed = runner.lengths - 1  # [B] the root pairs' columns (re-appended by commit)
            try:
                ids, parents, scores = self._grow(h_root, committed, caps, width, budget.max_nodes, sampling)
            finally:
                runner.lengths = committed  # drop the root pairs and the drafts
        return [rerank(root, runner.d2t, ids[b], parents[b], scores[b], budget.max_nodes)
                for b, root in enumerate(roots)]

    # -- internals -----------------------------------------------------------------------------

    def _fuse(self, features: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Per row [A_b, S, D] -> [A_b, D], in one matmul for the batch."""
        sizes = [f.shape[0] for f in features]
        return list(self.head.fuse(torch.cat([f.to(self._device) for f in features])).split(sizes))

    def _grow(self, h_root: torch.Tensor, committed: torch.Tensor, caps: torch.Tensor, width: int, max_nodes: int,
              sampling: SamplingConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h_root: [B, D]; committed, caps: [B]. Returns [B, N] draft ids, parents and scores of every
        drafted node (placeholders: score -inf), numbered from 1 depth by depth as in `EagleDrafter`."""
        runner, device = self._runner, h_root.device
        batch = h_root.shape[0]
        rows = torch.arange(batch, device=device)[:, None]
        child_slot = torch.arange(width, device=device).repeat_interleave(width)  # [w*w] parent slot of each child
        closed = torch.full((width, width), torch.finfo(runner.dtype).min, dtype=runner.dtype, device=device)
        diagonal = closed.fill_diagonal_(0.0)
        caps = caps.to(device)

        def children(h: torch.Tensor, base: torch.Tensor):
            """h [B, M, D], scores base [B, M] -> top-`w` children: ids, cumulative scores [B, M*w]."""
            m = h.shape[1]
            top_logp, top_ids = draft_log_probs(runner, h.reshape(batch * m, -1), sampling).topk(width, dim=-1)
            cumulative = base[..., None] + top_logp.view(batch, m, width)  # -inf stays -inf
            return top_ids.view(batch, m * width), cumulative.view(batch, m * width)

        ids, scores = children(h_root[:, None], torch.zeros(batch, 1, device=device))
        scores = scores.masked_fill((caps < 1)[:, None], NEG_INF)
        all_ids, all_parents, all_scores = [ids], [torch.zeros_like(ids)], [scores]
        first = 1  # node index of the newest depth's first node
        h = h_root[:, None]  # [B, M, D] of the rows expanded last: the newest depth's parents
        tree_mask = torch.zeros(batch, 1, 0, dtype=runner.dtype, device=device)  # the root pair sits in the prefix
        tree_start, visible = int(committed.max()) + 1, committed + 1
        for depth in range(2, int(caps.max()) + 1):
            ranked, order = torch.sort(scores, dim=1, descending=True, stable=True)  # ties: lower index first
            ranked, order = ranked[:, :width], order[:, :width]
            drafted = torch.cat(all_scores, dim=1)
            if drafted.shape[1] >= max_nodes:  # nodes no better than the max_nodes-th best have no kept descendant
                threshold = drafted.topk(max_nodes, dim=1).values[:, -1:]  # [B, 1]; -inf with fewer finite nodes
                ranked = ranked.masked_fill(ranked <= threshold, NEG_INF)
            ranked = ranked.masked_fill((caps < depth)[:, None], NEG_INF)
            m = int((ranked > NEG_INF).sum(1).max())  # live nodes come first in every row
            if m == 0:
                break
            ranked, order = ranked[:, :m], order[:, :m]
            parent_slots = child_slot[order]  # [B, m]: row of each expanded node's parent in h
            tree_mask = torch.cat([tree_mask[rows, parent_slots], diagonal[:m, :m].expand(batch, m, m)], dim=2)
            h = runner.draft(h[rows, parent_slots], runner.d2t[ids.gather(1, order)], committed + depth - 1,
                             tree_start, visible, tree_mask)
            nodes = order + first  # [B, m] node indices of the expanded
            first += scores.shape[1]
            ids, scores = children(h, ranked)
            all_ids.append(ids)
            all_parents.append(nodes[:, child_slot[: m * width]])
            all_scores.append(scores)
        return torch.cat(all_ids, dim=1), torch.cat(all_parents, dim=1), torch.cat(all_scores, dim=1)


def draft_log_probs(runner, h: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """[M, D] -> [M, V_draft] the head's draft log-probabilities (of the sampled distribution when
    sampling); runner: a `HeadRunner` (or `BatchHeadRunner`) of the head."""
    logits = runner.logits(h).float()
    if sampling.greedy:
        return torch.log_softmax(logits, dim=-1)
    return probabilities(logits, sampling).log()


def rerank(root_token: int, d2t: torch.Tensor, ids: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor,
           max_nodes: int) -> DraftTree:
    """The best `max_nodes` drafted nodes of finite score (ties: lower index), in node order, as a
    tree under the root. ids, parents, scores: [N] of nodes 1..N (parents index nodes, 0 the root)."""
    best = torch.sort(scores, descending=True, stable=True).indices[:max_nodes]
    best = best[scores[best] > NEG_INF].sort().values  # [K]
    kept = torch.cat([best.new_zeros(1), best + 1])  # node indices, root first, ascending
    new_parents = torch.searchsorted(kept, parents[best])  # closed under parents: every one is found
    return DraftTree(
        torch.cat([torch.tensor([root_token]), d2t[ids[best]].cpu()]),
        torch.cat([torch.tensor([-1]), new_parents.cpu()]),
        torch.cat([torch.zeros(1), scores[best].float().cpu()]),
    )
