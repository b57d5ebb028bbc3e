"""`EagleDrafter`: an EAGLE-2 dynamic draft tree (Li et al., 2024) grown by an `EagleHead`.

Cache handling. The head's keys and values live in a `HeadRunner`'s preallocated buffer whose
first `length` columns are exactly the committed pairs (features of position t, token t+1) whose
features came from the target. `begin` and `commit` only queue the new pairs (fusing their
features); `propose` runs them through the head in its first forward together with the pending
pair (features of the last committed position, root token), whose output gives the root's
children (only that last pair's attention and MLP are computed: the committed pairs' h is never
read). Each further depth is one batched forward of the frontier nodes chosen for expansion,
written into the buffer after the root pair with an ancestor mask, all at position C + d - 1 for
nodes at depth d - 1 (C = committed pairs). Before returning, `length` goes back to C: the root
pair and the drafts are simply overwritten by the next writes (the root pair's token is
committed next, by `commit`, and re-queued then).

Tree growth, as EAGLE-2's `topK_genrate`: the root's top-`w` children; at each further depth the
`w` best nodes of the newest depth by cumulative log-probability are expanded (one forward),
each into its top-`w` children; after `max_depth` depths every drafted node is reranked globally
by cumulative log-probability and the best `max_nodes` are kept. `w = min(branching, max_nodes)`:
with `branching >= max_nodes` the kept set is the exact top-`max_nodes` of the full
`branching`-ary tree either way (up to exact score ties), so a small budget does proportionally
less work. A child's cumulative log-probability never exceeds its parent's and ties go to the
lower (earlier) index, so the kept set is closed under parents, and a frontier node scoring no
better than the current `max_nodes`-th best drafted node cannot have a descendant in the kept
set: such nodes are not expanded, and growth stops once no frontier node beats that threshold.
This pruning never changes the kept set. When sampling, the draft distribution is the sampled one
(`moe_spec.core.sampling.probabilities`), and candidates it gives zero probability are not drafted.
"""

from __future__ import annotations

from pathlib import Path

import torch

from moe_spec.core.drafting import TreeBudget
from moe_spec.drafters.eagle_batch import EagleBatchDrafter, draft_log_probs, rerank
from moe_spec.drafters.eagle_head import EagleHead, HeadRunner, check_fits
from moe_spec.core.sampling import SamplingConfig
from moe_spec.core.target import TargetModel
from moe_spec.core.tree import DraftTree


class EagleDrafter:
    def __init__(self, head: EagleHead, target: TargetModel, budget: TreeBudget | None = None):
        check_fits(head.config, target)
        self.head = head.eval()
        self.target = target
        self.embed = target.model.get_input_embeddings()  # the target's, frozen, used as is
        self.default_budget = budget or TreeBudget(max_nodes=60, max_depth=5, branching=10)
        self._device = self.embed.weight.device
        self.head.to(self._device)
        self._runner = HeadRunner(self.head, self.embed)
        self._queued_g: list[torch.Tensor] = []  # each [A, D] fused target features of queued pairs
        self._queued_tokens: list[torch.Tensor] = []  # each [A] long: the tokens of those pairs
        self._last_g: torch.Tensor | None = None  # [1, D] fused features of the last committed position
        self._tables: dict = {}  # per (width, dtype): constant index/mask tensors of `_grow`

    @staticmethod
    def from_pretrained(directory: str | Path, target: TargetModel, budget: TreeBudget | None = None) -> "EagleDrafter":
        return EagleDrafter(EagleHead.from_pretrained(directory), target, budget)

    def save_pretrained(self, directory: str | Path) -> None:
        self.head.save_pretrained(directory)

    def spawn(self) -> EagleDrafter:
        """A fresh drafter sharing this one's head (weights) and budget, with its own cache."""
        return EagleDrafter(self.head, self.target, self.default_budget)

    def for_batch(self, batch: int) -> EagleBatchDrafter:
        """A drafter for `batch` rows sharing this one's head and budget: one head forward per
        tree depth for all rows (`moe_spec.drafters.eagle_batch`)."""
        return EagleBatchDrafter(self.head, self.target, batch, self.default_budget)

    @property
    def rows_drafted(self) -> int:
        """Tree rows the head has run so far (expanded nodes at depths >= 1, over all `propose` calls)."""
        return self._runner.rows_drafted

    # -- the Drafter protocol ----------------------------------------------------------------

    @torch.inference_mode()
    def begin(self, prompt: torch.Tensor, features: torch.Tensor) -> None:
        """prompt: [T] long; features: [T, S, D]."""
        self._runner.reset()
        self._queued_g, self._queued_tokens = [], []
        g = self.head.fuse(features.to(self._device))  # [T, D]
        if prompt.numel() > 1:
            self._queue(g[:-1], prompt[1:])
        self._last_g = g[-1:]

    @torch.inference_mode()
    def commit(self, tokens: torch.Tensor, features: torch.Tensor) -> None:
        """tokens: [A] long; features: [A, S, D]. Pairs (previous features, tokens[0]), (features[0], tokens[1]), ..."""
        g = self.head.fuse(features.to(self._device))  # [A, D]
        self._queue(torch.cat([self._last_g, g[:-1]]), tokens)
        self._last_g = g[-1:]

    def propose(self, root_token: int, budget: TreeBudget, sampling: SamplingConfig) -> DraftTree:
        if self._last_g is None:
            raise RuntimeError("EagleDrafter.propose called before begin")
        max_depth = min(budget.max_depth, budget.max_nodes)
        if max_depth == 0:
            return DraftTree.root_only(root_token)
        width = min(budget.branching, budget.max_nodes, self.head.config.draft_vocab_size)
        with torch.inference_mode():
            runner = self._runner
            runner.refresh()
            # depth 0: queued committed pairs + the root pair, causally, in one forward
            g = torch.cat(self._queued_g + [self._last_g])  # [A, D]
            tokens = torch.cat(self._queued_tokens + [torch.tensor([root_token], device=self._device)])
            self._queued_g, self._queued_tokens = [], []
            h_root = runner.extend(g, tokens)  # [D]
            committed = runner.length - 1  # the root pair is re-queued by commit
            try:
                ids, parents, scores = self._grow(h_root, committed, max_depth, width, budget.max_nodes, sampling)
            finally:
                runner.length = committed  # drop the root pair and the drafts
        # outside inference mode, so the tree holds ordinary tensors
        return rerank(root_token, self._runner.d2t, ids, parents, scores, budget.max_nodes)

    # -- internals -----------------------------------------------------------------------------

    def _queue(self, g: torch.Tensor, tokens: torch.Tensor) -> None:
        """g: [A, D] fused target features; tokens: [A] the tokens that follow them."""
        self._queued_g.append(g)
        self._queued_tokens.append(tokens.to(self._device, torch.long))

    def _constants(self, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(row of each child [w * w], tree mask of a lone root [1, 1], diagonal mask [w, w]) for `_grow`."""
        dtype = self._runner.dtype
        key = (width, dtype)
        if key not in self._tables:
            closed = torch.full((width, width), torch.finfo(dtype).min, dtype=dtype, device=self._device)
            self._tables[key] = (
                torch.arange(width, device=self._device).repeat_interleave(width),
                torch.zeros(1, 1, dtype=dtype, device=self._device),
                closed.fill_diagonal_(0.0),
            )
        return self._tables[key]

    def _grow(self, h_root: torch.Tensor, committed: int, max_depth: int, width: int, max_nodes: int,
              sampling: SamplingConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h_root: [D] the root pair's output. Returns every drafted node's (draft id, parent, score);
        nodes are numbered from 1 (the root is 0) depth by depth, each depth in expansion order."""
        runner, greedy = self._runner, sampling.greedy
        child_rows, tree_mask, diagonal = self._constants(width)

        def children(h: torch.Tensor, base: torch.Tensor):
            """h: [M, D] of expanded nodes with cumulative scores base [M] -> their top-`width` children:
            (draft ids, cumulative scores, row of the parent in h), candidates of probability zero dropped."""
            top_logp, top_ids = draft_log_probs(runner, h, sampling).topk(width, dim=-1)  # [M, w] each
            cumulative = (base[:, None] + top_logp).view(-1)
            ids, rows = top_ids.view(-1), child_rows[: cumulative.numel()]
            if greedy:  # log_softmax of finite logits is finite
                return ids, cumulative, rows
            keep = cumulative > float("-inf")
            return ids[keep], cumulative[keep], rows[keep]

        ids, scores, rows = children(h_root[None], torch.zeros(1, device=h_root.device))
        all_ids, all_parents, all_scores = [ids], [torch.zeros_like(ids)], [scores]
        first, drafted = 1, ids.numel()  # node index of the newest depth's first node; nodes so far
        h = h_root[None]  # h of the rows expanded last: the newest depth's parents
        for depth in range(2, max_depth + 1):
            if scores.numel() == 0:
                break
            ranked, order = torch.sort(scores, descending=True, stable=True)  # ties: lower index first
            ranked, order = ranked[:width], order[:width]
            if drafted >= max_nodes:  # nodes no better than the max_nodes-th best have no kept descendant
                threshold = torch.cat(all_scores).topk(max_nodes).values[-1]
                m = int((ranked > threshold).sum())
                if m == 0:
                    break
                ranked, order = ranked[:m], order[:m]
            m = order.numel()
            parent_rows = rows[order]
            tree_mask = torch.cat([tree_mask[parent_rows], diagonal[:m, :m]], dim=1)  # [m, tree columns]
            h = runner.draft(h[parent_rows], runner.d2t[ids[order]], committed + depth - 1, committed, tree_mask)
            nodes = order + first  # node indices of the expanded
            first += scores.numel()
            ids, scores, rows = children(h, ranked)
            all_ids.append(ids)
            all_parents.append(nodes[rows])
            all_scores.append(scores)
            drafted += ids.numel()
        return torch.cat(all_ids), torch.cat(all_parents), torch.cat(all_scores)
