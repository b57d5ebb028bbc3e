"""Capture which experts each token routes to, through forward hooks on the routers.

`RoutingRecorder` is a context manager: it hooks every router of the model on entry, reads
the `topk_indices` each router returns, and removes every hook on exit, also when the forward
raises. Hooks only read outputs, so logits are unchanged.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import nn

from moe_spec.core.architectures import ArchitectureSpec, architecture_of

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


@dataclass(frozen=True)
class RouterInfo:
    layer: int  # decoder layer index the router belongs to
    module: nn.Module
    num_experts: int
    top_k: int


def find_routers(model: nn.Module, spec: ArchitectureSpec | None = None) -> list[RouterInfo]:
    """The routers of a model, ordered by decoder layer (empty for a dense model)."""
    spec = spec or architecture_of(model)
    if not spec.is_moe:
        return []
    routers = []
    for name, module in model.named_modules():
        if type(module).__name__ != spec.router_class:
            continue
        match = _LAYER_INDEX.search(name)
        if match is None:
            raise RuntimeError(f"router {name!r} is not inside a numbered decoder layer")
        routers.append(RouterInfo(int(match.group(1)), module, int(module.num_experts), int(module.top_k)))
    return sorted(routers, key=lambda r: r.layer)


@dataclass(frozen=True)
class Routing:
    """Top-k expert ids per MoE layer for each token of one forward pass."""

    layers: tuple[int, ...]  # decoder layer index of each MoE layer
    num_experts: int
    experts: torch.Tensor  # [L, T, K] long; T = tokens of the forward, flattened over the batch

    @property
    def num_tokens(self) -> int:
        return int(self.experts.shape[1]) if self.experts.numel() else 0

    def unique_per_layer(self) -> list[int]:
        """Distinct experts each MoE layer activated over these tokens (counted once per pass: the
        step's stats, the controller's cost correction and observers all read it)."""
        return list(self._unique)

    @cached_property
    def _unique(self) -> tuple[int, ...]:
        return tuple(self.activation().sum(1).tolist())  # one scatter for all layers (not a `unique` per layer)

    def activation(self) -> torch.Tensor:
        """[L, E] bool: whether each expert was activated by any token."""
        active = torch.zeros(len(self.layers), self.num_experts, dtype=torch.bool)
        if self.experts.numel():
            active.scatter_(1, self.experts.flatten(1), True)
        return active


def empty_routing() -> Routing:
    return Routing((), 0, torch.zeros(0, 0, 0, dtype=torch.long))


class RouterHooks:
    """Base context manager: one forward hook on every router (built by `_hook_for`), all of them
    removed on exit, also when the forward raises. Subclasses decide what a hook does."""

    def __init__(self, routers: list[RouterInfo]):
        self._routers = routers
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def __enter__(self):
        self._on_enter()
        try:
            for position, router in enumerate(self._routers):
                self._handles.append(router.module.register_forward_hook(self._hook_for(position, router)))
        except BaseException:
            self._remove_hooks()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self._remove_hooks()

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _on_enter(self) -> None:
        """Reset per-context state before the hooks go on."""

    def _hook_for(self, position: int, router: RouterInfo):
        raise NotImplementedError


class RoutingRecorder(RouterHooks):
    """Context manager recording each router's top-k indices for every forward inside it.

    >>> with RoutingRecorder(model) as recorder:
    ...     model(input_ids)
    >>> recorder.routing().experts.shape  # [L, T, K]
    """

    def __init__(self, model: nn.Module, spec: ArchitectureSpec | None = None, routers: list[RouterInfo] | None = None):
        # `routers`: the model's, already found (a TargetModel keeps them), so that a recorder
        # entered once per decoding step does not walk the whole module tree each time
        super().__init__(find_routers(model, spec) if routers is None else routers)
        self._records: dict[int, list[torch.Tensor]] = {}

    def _on_enter(self) -> None:
        self._records = {r.layer: [] for r in self._routers}

    def _hook_for(self, position: int, router: RouterInfo):
        records = self._records[router.layer]

        def hook(module, inputs, output):
            topk_indices = output[2]  # [T, K]
            # kept on the router's device: a copy to the host here would wait for every layer in turn
            records.append(topk_indices.detach().reshape(-1, topk_indices.shape[-1]))

        return hook

    def routing(self) -> Routing:
        """Everything recorded so far, tokens of successive forwards concatenated."""
        if not self._routers:
            return empty_routing()
        # one forward recorded (a decoding step): each layer's single record as it is, no copy
        per_layer = [records[0] if len(records) == 1 else torch.cat(records, dim=0)
                     for records in (self._records[r.layer] for r in self._routers)]
        device = per_layer[0].device  # layers may sit on several devices (a dispatched model)
        # routing reaches Python here (controllers, statistics, traces read it): one copy to the host
        experts = torch.stack([layer.to(device) for layer in per_layer]).long().cpu()
        return Routing(layers=tuple(r.layer for r in self._routers), num_experts=self._routers[0].num_experts,
                       experts=experts)
