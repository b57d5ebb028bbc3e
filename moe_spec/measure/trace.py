"""Real decoding with full candidate trees, recorded for the profiler.

Each step drafts a candidate tree with the drafter's budget, verifies *all* of it in one
target forward (no controller), accepts greedily and keeps the accepted path, exactly as
`SpecDecoder` does without a controller. Unlike the engine it keeps what the profiler needs
per step: the tree, the routing of every node and the target's argmax at every node.

Labels (greedy):
- a node is *on the accepted path* when it and all its ancestors were accepted;
- a node is *conditionally accepted* when its token equals the target's argmax at its parent.
  The target's logits at a node are computed over that node's own root path (tree mask), so
  this label is defined for every node, reached or not; a node is on the accepted path iff
  every node on its path (root excluded) is conditionally accepted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from moe_spec.core.acceptance import accept_greedy
from moe_spec.core.drafting import BatchDrafter, Drafter, TreeBudget, batch_drafter
from moe_spec.core.kv_cache import keep_accepted_path
from moe_spec.core.sampling import SamplingConfig
from moe_spec.core.target import TargetModel
from moe_spec.core.tree import DraftTree, ancestor_mask

_GREEDY = SamplingConfig(0.0, 0, 1.0)


@dataclass(frozen=True)
class TracedStep:
    prompt_index: int
    prefix_len: int  # cached positions before the step
    tree: DraftTree
    experts: torch.Tensor  # [L, N, K] long: routing of every node
    argmax: torch.Tensor  # [N] long: target argmax at every node
    path: tuple[int, ...]  # accepted path, root included
    verify_ms: float
    draft_ms: float

    @property
    def conditional_accepted(self) -> torch.Tensor:
        """[N] bool: token equals the target's argmax at the parent (root: True)."""
        parents = self.tree.parents.clamp(min=0)
        labels = self.tree.tokens == self.argmax[parents]
        labels[0] = True
        return labels

    @property
    def on_path(self) -> torch.Tensor:
        """[N] bool: node lies on the accepted path (root: True)."""
        labels = torch.zeros(len(self.tree), dtype=torch.bool)
        labels[list(self.path)] = True
        return labels


@dataclass(frozen=True)
class PromptTrace:
    prompt_index: int
    tokens: torch.Tensor  # [T] long: prompt then committed tokens (the sequence the target saw)
    experts: torch.Tensor  # [L, T, K] long: routing of those tokens in context
    steps: tuple[TracedStep, ...]


def trace_prompt(
    target: TargetModel,
    drafter: Drafter | BatchDrafter | None,
    prompt: torch.Tensor,  # [T] long
    max_new_tokens: int,
    budget: TreeBudget | None = None,
    prompt_index: int = 0,
) -> PromptTrace:
    """Greedy speculative decoding of one prompt, recording every step (see module docstring)."""
    cache = target.new_cache()
    n = prompt.numel()
    prefill = target.forward_tree(cache, prompt[None], torch.tril(torch.ones(n, n, dtype=torch.bool))[None], torch.arange(n)[None])
    root = int(prefill.logits[0, -1].argmax())
    context_experts = [prefill.routing.experts]
    context_tokens = [prompt]
    rows = batch_drafter(drafter, 1) if drafter is not None else None  # one prompt: a batch of one
    if rows is not None:
        rows.begin([prompt], [prefill.features[0].cpu()])
    produced = 1
    steps = []
    while produced < max_new_tokens:
        remaining = max_new_tokens - produced
        t0 = time.perf_counter()
        tree = _draft(rows, root, budget, remaining)
        t1 = time.perf_counter()
        prefix_len = cache.get_seq_length()
        out = target.forward_tree(cache, tree.tokens[None], ancestor_mask(tree)[None], (prefix_len + tree.depths)[None])
        t2 = time.perf_counter()
        logits = out.logits[0].float().cpu()  # [N, V]
        acceptance = accept_greedy(tree, logits)
        keep_accepted_path(cache, prefix_len, acceptance.path)
        path = torch.tensor(acceptance.path)
        if rows is not None:
            rows.commit([tree.tokens[path]], [out.features[0, path].cpu()])
        steps.append(
            TracedStep(
                prompt_index=prompt_index,
                prefix_len=prefix_len,
                tree=tree,
                experts=out.routing.experts,
                argmax=logits.argmax(-1),
                path=tuple(acceptance.path),
                verify_ms=(t2 - t1) * 1000,
                draft_ms=(t1 - t0) * 1000,
            )
        )
        context_tokens.append(tree.tokens[path])
        if target.is_moe:
            context_experts.append(out.routing.experts[:, path])
        produced += len(acceptance.path)  # accepted drafts plus the bonus
        root = acceptance.bonus_token
    return PromptTrace(
        prompt_index=prompt_index,
        tokens=torch.cat(context_tokens),
        experts=torch.cat(context_experts, dim=1) if target.is_moe else torch.zeros(0, 0, 0, dtype=torch.long),
        steps=tuple(steps),
    )


def _draft(drafter: BatchDrafter | None, root: int, budget: TreeBudget | None, remaining: int) -> DraftTree:
    if drafter is None or remaining <= 1:
        return DraftTree.root_only(root)
    budget = (budget or drafter.default_budget).capped(remaining - 1)
    tree = drafter.propose([root], budget, [budget.max_depth], _GREEDY)[0]
    if int(tree.depths.max()) > remaining - 1:
        tree = tree.subtree((tree.depths <= remaining - 1).nonzero().flatten())
    return tree


def best_first_order(tree: DraftTree) -> list[int]:
    """Node indices by decreasing cumulative draft score (ties: lower index), root first.

    A child's cumulative score never exceeds its parent's, so every prefix of this order is a
    connected subtree: the nodes a score-truncating controller would verify.
    """
    order = sorted(range(1, len(tree)), key=lambda i: (-float(tree.scores[i]), i))
    return [0] + order

