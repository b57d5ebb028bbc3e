"""Forcing the routers' choices, to time a verify pass at a chosen number of unique experts.

Profiling only, never decoding: the forced experts change the model's output. `ForcedRouting`
hooks every router and replaces the `topk_indices` of the triple it returns with a given
assignment; the gate weights are kept (their values do not change the cost). Hooks are
removed on exit, also when the forward raises. Hooks registered later (e.g. the
`RoutingRecorder` inside `TargetModel.forward_tree`) see the forced indices.
"""

from __future__ import annotations

import torch
from torch import nn

from moe_spec.core.routing import RouterHooks, RouterInfo, find_routers


def forced_assignment(
    num_tokens: int, unique_experts: int, num_experts: int, top_k: int, generator: torch.Generator
) -> torch.Tensor:
    """[T, K] long: each token gets K distinct experts out of a random set of U, and the T tokens
    together cover all U (needs K <= U <= min(E, T * K)). Consecutive tokens take consecutive
    K-slices of the set, cycling, so the U experts are loaded about equally."""
    if not top_k <= unique_experts <= min(num_experts, num_tokens * top_k):
        raise ValueError(
            f"cannot force U={unique_experts} unique experts with T={num_tokens}, K={top_k}, E={num_experts}"
        )
    chosen = torch.randperm(num_experts, generator=generator)[:unique_experts]  # [U]
    slots = torch.arange(num_tokens)[:, None] * top_k + torch.arange(top_k)[None, :]  # [T, K]
    return chosen[slots % unique_experts]


def feasible(num_tokens: int, unique_experts: int, num_experts: int, top_k: int) -> bool:
    return top_k <= unique_experts <= min(num_experts, num_tokens * top_k)


class ForcedRouting(RouterHooks):
    """Context manager: routers return `experts[l]` ([T, K]) as their top-k indices.

    experts: [L, T, K] long, one assignment per MoE layer in `find_routers` order. Every
    forward inside the context must run exactly T tokens.
    """

    def __init__(self, model: nn.Module, experts: torch.Tensor):
        super().__init__(find_routers(model))
        if experts.dim() != 3 or experts.shape[0] != len(self._routers):
            raise ValueError(f"experts must be [L={len(self._routers)}, T, K], got {tuple(experts.shape)}")
        self._experts = experts.long()

    def _hook_for(self, position: int, router: RouterInfo):
        forced = self._experts[position]  # [T, K]

        def hook(module, inputs, output):
            logits, weights, indices = output  # indices: [T, K]
            if indices.shape != forced.shape:
                raise ValueError(f"forced routing is for {tuple(forced.shape)} tokens x top-k, router gave {tuple(indices.shape)}")
            return logits, weights, forced.to(device=indices.device, dtype=indices.dtype)

        return hook
