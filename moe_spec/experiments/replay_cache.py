"""Pricing a replayed verify pass, with every expert resident or behind a resident cache.

Resident (`Pricing(cost)`): a pass of nodes S costs `cost.predict_ms(|S|, U)`, U[l] the distinct
experts layer l loads for S by their recorded routing.

Offloaded (`Pricing(cost, resident=C)`): the cost model's `fetch` term (`scripts/profile_fetch.py`
measures it on the tier) is added for the experts the pass misses, M[l] of its U[l] not resident. The
resident experts are those a cache of C slots per MoE layer holds after the policy's own earlier
passes of the same prompt (the `LayerCache` the offloaded target runs, without weights: the same
admissions and evictions). Every policy's replay runs its own `PricedPasses`, so each is charged the
misses its own choices leave, and a controller that prices residency (`moe-aware`) reads its cache
as it reads the live one. A prompt starts from a cold cache, as `bench` starts each generation; the
prefill's reads are not replayed (the trace does not record its routing), so a prompt's first steps
miss more than they did live, for every policy alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from moe_spec.core.step_record import StepRecord
from moe_spec.errors import InputError
from moe_spec.offload.resident_cache import Eviction, LayerCache
from moe_spec.profile.cost_model import CostModel


def needed_experts(step: StepRecord, keep: Sequence[int]) -> list[np.ndarray]:
    """Per MoE layer, the distinct experts (sorted) the nodes `keep` route to, by the recorded routing."""
    chosen = step.experts()[:, list(keep)]  # [L, |S|, K]
    return [np.unique(layer.numpy()) for layer in chosen]


class ReplayCache:
    """The resident experts of an offloaded target (C slots per MoE layer, `eviction`) as replayed
    passes leave them."""

    def __init__(self, num_layers: int, num_experts: int, resident: int, eviction: Eviction = Eviction.LRU):
        if num_layers < 1 or not 1 <= resident <= num_experts:
            raise InputError(f"resident experts must be 1..{num_experts} per layer of an MoE target "
                             f"({num_layers} MoE layers), got {resident}")
        self.layers = [LayerCache(num_experts, resident, 0, [], torch.float32, "cpu", eviction)
                       for _ in range(num_layers)]

    def clear(self) -> None:
        for layer in self.layers:
            layer.clear()

    def residency(self) -> torch.Tensor:
        """[L, E] bool: resident now (what a controller pricing residency reads)."""
        return torch.from_numpy(np.stack([layer.resident for layer in self.layers]))

    def misses(self, needed: list[np.ndarray]) -> list[int]:
        """[L] experts of `needed` (per layer) not resident, leaving the cache as it is."""
        return [int((~layer.resident[experts]).sum()) for layer, experts in zip(self.layers, needed)]

    def visit(self, needed: list[np.ndarray]) -> list[int]:
        """A pass loading `needed` (per layer): its misses per layer, admitted as the live cache admits them."""
        misses = []
        for layer, experts in zip(self.layers, needed):
            plan = layer.plan(experts.tolist())
            layer.commit(plan.admitted)
            misses.append(plan.misses)
        return misses


@dataclass(frozen=True)
class Pricing:
    """What a replayed pass costs: `cost`, and where `resident` is given (experts per MoE layer), the
    fetches of the misses a cache of that size leaves (see the module docstring)."""

    cost: CostModel
    resident: int | None = None
    eviction: Eviction = Eviction.LRU

    def __post_init__(self):
        if self.resident is not None and self.cost.fetch is None:
            raise InputError(f"resident experts ({self.resident}) need a cost model with a fetch cost: the profile of "
                             f"an offload tier (scripts/profile_fetch.py), not {self.cost.source!r}")

    @property
    def offloaded(self) -> bool:
        return self.resident is not None

    def passes(self, num_experts: int) -> "PricedPasses":
        """A fresh sequence of passes, for one policy's replay."""
        cache = (ReplayCache(self.cost.num_layers, num_experts, self.resident, self.eviction)
                 if self.resident is not None else None)
        return PricedPasses(self.cost, cache)


class PricedPasses:
    """One policy's replayed passes in order: `begin` at each prompt, `verify` for each pass."""

    def __init__(self, cost: CostModel, cache: ReplayCache | None):
        self.cost = cost
        self.cache = cache

    @property
    def residency(self):
        """() -> [L, E] bool resident now, or None (every expert resident): a controller's `residency`."""
        return self.cache.residency if self.cache is not None else None

    def begin(self) -> None:
        """A new prompt: a cold cache."""
        if self.cache is not None:
            self.cache.clear()

    def peek_ms(self, step: StepRecord, keep: Sequence[int]) -> float:
        """What verifying `keep` would cost now, leaving the cache as it is."""
        needed = needed_experts(step, keep)
        misses = self.cache.misses(needed) if self.cache is not None else None
        return self.cost.predict_ms(len(keep), [len(e) for e in needed], misses=misses)

    def verify(self, step: StepRecord, keep: Sequence[int]) -> tuple[float, int | None, tuple[int, ...]]:
        """What verifying `keep` costs (ms), its misses admitted into the cache; how many experts it
        fetched over all layers (None: every expert resident); and [L] the distinct experts each
        layer loads."""
        needed = needed_experts(step, keep)
        unique = tuple(len(e) for e in needed)
        misses = self.cache.visit(needed) if self.cache is not None else None
        return (self.cost.predict_ms(len(keep), unique, misses=misses), sum(misses) if misses is not None else None,
                unique)
