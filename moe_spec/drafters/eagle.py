"""`EagleDrafter`: an EAGLE-2 dynamic draft tree (Li et al., 2024) grown by an `EagleHead`.

Cache handling. The head keeps its own `DynamicCache` holding exactly the committed pairs
(features of position t, token t+1) whose features came from the target. `begin` and `commit`
only queue the new pairs (no compute); `propose` runs them through the head in its first forward
together with the pending pair (features of the last committed position, root token), whose
output gives the root's children. Each further depth is one batched forward of the frontier
nodes chosen for expansion, appended to the cache with an ancestor mask and explicit positions
(a node at depth d sits at position C + d, C = committed pairs); before returning, everything
after the C committed pairs is cropped away (the root pair too: its token is committed next, by
`commit`, and re-queued then).

Tree growth, as EAGLE-2's `topK_genrate`: the root's top-`branching` children; at each further
depth the `branching` best nodes of the newest depth by cumulative log-probability are expanded
(one forward), each into its top-`branching` children; after `max_depth` depths every drafted node
is reranked globally by cumulative log-probability and the best `max_nodes` are kept. A child's
cumulative log-probability never exceeds its parent's and ties go to the lower (earlier) index,
so the kept set is closed under parents. When sampling, the draft distribution is the sampled
one (`moe_spec.sampling.probabilities`), and candidates it gives zero probability are not drafted.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import DynamicCache

from moe_spec.drafters.base import TreeBudget
from moe_spec.drafters.eagle_head import EagleHead, additive_mask, check_fits
from moe_spec.sampling import SamplingConfig, probabilities
from moe_spec.target import TargetModel
from moe_spec.tree import DraftTree


class EagleDrafter:
    def __init__(self, head: EagleHead, target: TargetModel, budget: TreeBudget | None = None):
        check_fits(head.config, target)
        self.head = head.eval()
        self.embed = target.model.get_input_embeddings()  # the target's, frozen, used as is
        self.default_budget = budget or TreeBudget(max_nodes=60, max_depth=5, branching=10)
        self._device = self.embed.weight.device
        self.head.to(self._device)
        self._cache = DynamicCache()
        self._queued_g: list[torch.Tensor] = []  # each [A, D] fused target features of queued pairs
        self._queued_tokens: list[torch.Tensor] = []  # each [A] long: the tokens of those pairs
        self._last_features: torch.Tensor | None = None  # [S, D] of the last committed position

    @staticmethod
    def from_pretrained(directory: str | Path, target: TargetModel, budget: TreeBudget | None = None) -> "EagleDrafter":
        return EagleDrafter(EagleHead.from_pretrained(directory), target, budget)

    def save_pretrained(self, directory: str | Path) -> None:
        self.head.save_pretrained(directory)

    # -- the Drafter protocol ----------------------------------------------------------------

    @torch.no_grad()
    def begin(self, prompt: torch.Tensor, features: torch.Tensor) -> None:
        """prompt: [T] long; features: [T, S, D]."""
        self._cache = DynamicCache()
        self._queued_g, self._queued_tokens = [], []
        features = features.to(self._device)
        if prompt.numel() > 1:
            self._queue(features[:-1], prompt[1:])
        self._last_features = features[-1]

    @torch.no_grad()
    def commit(self, tokens: torch.Tensor, features: torch.Tensor) -> None:
        """tokens: [A] long; features: [A, S, D]. Pairs (previous features, tokens[0]), (features[0], tokens[1]), ..."""
        features = features.to(self._device)
        self._queue(torch.cat([self._last_features[None], features[:-1]]), tokens)
        self._last_features = features[-1]

    @torch.no_grad()
    def propose(self, root_token: int, budget: TreeBudget, sampling: SamplingConfig) -> DraftTree:
        if self._last_features is None:
            raise RuntimeError("EagleDrafter.propose called before begin")
        max_depth = min(budget.max_depth, budget.max_nodes)
        if max_depth == 0:
            return DraftTree.root_only(root_token)
        width = min(budget.branching, self.head.config.draft_vocab_size)

        # depth 0: queued committed pairs + the root pair, causally, in one forward
        self._queue(self._last_features[None], torch.tensor([root_token]))
        g = torch.cat(self._queued_g)  # [A, D]
        tokens = torch.cat(self._queued_tokens).to(self._device)  # [A]
        self._queued_g, self._queued_tokens = [], []
        start = self._cache.get_seq_length()
        n = tokens.numel()
        visible = torch.cat([torch.ones(n, start, dtype=torch.bool), torch.tril(torch.ones(n, n, dtype=torch.bool))], -1)
        h = self._forward(g, tokens, visible, torch.arange(start, start + n))  # [A, D]
        committed = start + n - 1  # the root pair is re-queued by commit
        try:
            return self._grow(root_token, h[-1], committed, max_depth, width, budget.max_nodes, sampling)
        finally:
            self._cache.crop(committed - self._cache.get_seq_length())  # negative: drop the drafts

    # -- internals -----------------------------------------------------------------------------

    def _queue(self, features: torch.Tensor, tokens: torch.Tensor) -> None:
        """features: [A, S, D] target features; tokens: [A] the tokens that follow them."""
        self._queued_g.append(self.head.fuse(features))  # [A, D]
        self._queued_tokens.append(tokens.long().cpu())

    def _forward(self, g: torch.Tensor, tokens: torch.Tensor, visible: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One head forward of N pairs. g: [N, D]; tokens: [N] target ids; visible: [N, P + N] bool."""
        embeds = self.embed(tokens.to(self._device))  # [N, D]
        mask = additive_mask(visible.to(self._device)[None], self.head.proj.weight.dtype)  # [1, 1, N, P + N]
        return self.head(g[None], embeds[None], mask, positions.to(self._device)[None], self._cache)[0]

    def _log_probs(self, h: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
        """[M, D] -> [M, V_draft] draft log-probabilities (of the sampled distribution when sampling)."""
        logits = self.head.logits(h).float()
        if sampling.greedy:
            return torch.log_softmax(logits, dim=-1)
        return probabilities(logits, sampling).log()

    def _grow(self, root_token: int, h_root: torch.Tensor, committed: int, max_depth: int, width: int,
              max_nodes: int, sampling: SamplingConfig) -> DraftTree:
        """h_root: [D] the root pair's output. Node 0 is the root; nodes are numbered depth by depth."""
        tokens = [torch.tensor([-1])]  # per depth: [M_d] draft ids
        parents = [torch.tensor([-1])]  # per depth: [M_d] node index of the parent
        scores = [torch.zeros(1)]  # per depth: [M_d] cumulative draft log-probability
        h_of = {0: h_root}  # expanded node -> its h [D]: its children's g
        seen = {0: torch.zeros(committed + 1, dtype=torch.bool)}  # expanded node -> head cache columns it sees
        seen[0][committed] = True  # the root pair; committed pairs are added to every row below

        def add_children(nodes: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            """nodes: [M] expanded; h: [M, D]. Appends their top-`width` children; returns (ids, scores) of them."""
            logp = self._log_probs(h, sampling)  # [M, V_draft]
            top_logp, top_ids = (t.cpu() for t in logp.topk(width, dim=-1))  # [M, width] each
            cumulative = (node_scores[nodes][:, None] + top_logp).flatten()  # [M * width]
            keep = cumulative > float("-inf")  # candidates the sampled draft can never produce are not drafted
            first = sum(t.numel() for t in tokens)
            tokens.append(top_ids.flatten()[keep])
            parents.append(nodes[:, None].expand(-1, width).flatten()[keep])
            scores.append(cumulative[keep])
            return torch.arange(first, first + int(keep.sum())), scores[-1]

        node_scores = torch.zeros(1)
        frontier, frontier_scores = add_children(torch.tensor([0]), h_root[None])
        for depth in range(2, max_depth + 1):
            if frontier.numel() == 0:
                break
            all_parents = torch.cat(parents)
            all_tokens = torch.cat(tokens)
            best = torch.sort(frontier_scores, descending=True, stable=True).indices[:width]  # ties: lower index
            order = frontier[best]  # [M] nodes to expand
            length = self._cache.get_seq_length()
            m = order.numel()
            visible = torch.zeros(m, length + m, dtype=torch.bool)
            visible[:, :committed] = True
            for row, node in enumerate(order.tolist()):
                parent_seen = seen[int(all_parents[node])]
                visible[row, : parent_seen.numel()] |= parent_seen
                visible[row, length + row] = True
                seen[node] = visible[row].clone()
            g = torch.stack([h_of[int(p)] for p in all_parents[order]])  # [M, D]: parents' h stand in for features
            ids = self.head.draft_to_target[all_tokens[order].to(self._device)]
            h = self._forward(g, ids, visible, torch.full((m,), committed + depth - 1))  # [M, D]
            h_of.update(zip(order.tolist(), h))
            node_scores = torch.cat(scores)
            frontier, frontier_scores = add_children(order, h)

        all_scores = torch.cat(scores)
        keep = torch.sort(all_scores[1:], descending=True, stable=True).indices[:max_nodes] + 1
        ids = torch.cat(tokens)
        ids[1:] = self.head.draft_to_target[ids[1:].to(self._device)].cpu()
        ids[0] = root_token
        tree = DraftTree(ids, torch.cat(parents), all_scores.float())
        return tree.subtree(torch.cat([torch.tensor([0]), keep]))
