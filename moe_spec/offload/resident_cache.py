"""Which experts of one MoE layer sit in fast memory, and which slot each would go to.

A `LayerCache` owns `capacity` resident slots and `scratch` slots of one layer's experts (one
tensor per expert parameter, `[slots, *shape]`, on the compute device). `plan(needed)` splits the
experts a pass needs into hits (resident), misses admitted into resident slots (evicting the
least recently used, or least frequently used, experts the pass does not need) and the overflow
that streams through the scratch slots when the pass needs more experts than `capacity`.

Consistency under failure: a victim's slot is marked empty *before* its new expert is read, and a
slot is marked resident only by `commit` after its read completed, so an exception mid-read
leaves no slot claiming an expert whose weights are half there (`abort` forgets the admissions).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np
import torch


class Eviction(str, Enum):
    LRU = "lru"
    LFU = "lfu"  # least frequently used since admission, ties to the least recently used


@dataclass(frozen=True)
class PassPlan:
    """Where each expert a pass needs comes from."""

    hits: list[tuple[int, int]]  # (expert, resident slot) already in fast memory
    admitted: list[tuple[int, int]]  # (expert, resident slot) to read now and keep
    overflow: list[int]  # experts beyond the resident slots: read into scratch slots, chunk by chunk

    @property
    def misses(self) -> int:
        return len(self.admitted) + len(self.overflow)


class LayerCache:
    def __init__(self, num_experts: int, capacity: int, scratch: int, shapes: list[tuple[int, ...]],
                 dtype: torch.dtype, device: torch.device | str, eviction: Eviction = Eviction.LRU):
        if capacity < 0 or scratch < 0 or capacity + scratch < 1:
            raise ValueError(f"a layer cache needs slots: capacity={capacity}, scratch={scratch}")
        self.num_experts = num_experts
        self.capacity = capacity
        self.scratch = scratch
        self.eviction = Eviction(eviction)
        # [capacity + scratch, *shape] per expert parameter: resident slots first, then scratch
        self.slots = [torch.empty((capacity + scratch, *shape), dtype=dtype, device=device) for shape in shapes]
        self.expert_of_slot = np.full(capacity, -1, dtype=np.int64)  # [C] -1: empty
        self.slot_of_expert = np.full(num_experts, -1, dtype=np.int64)  # [E] -1: not resident
        self.last_used = np.zeros(capacity, dtype=np.int64)  # [C] pass counter at last use
        self.uses = np.zeros(capacity, dtype=np.int64)  # [C] passes that used the slot's expert
        self._clock = 0

    @property
    def resident(self) -> np.ndarray:
        """[E] bool: which experts are in fast memory now."""
        return self.slot_of_expert >= 0

    def scratch_slot(self, index: int) -> int:
        return self.capacity + index

    def plan(self, needed: list[int]) -> PassPlan:
        """Hits, admissions and overflow for a pass needing the experts `needed` (distinct ids).
        Victims' slots are emptied here; `commit` marks the admitted experts resident once read."""
        self._clock += 1
        hits = [(e, int(self.slot_of_expert[e])) for e in needed if self.slot_of_expert[e] >= 0]
        missing = [e for e in needed if self.slot_of_expert[e] < 0]
        for _, slot in hits:
            self._touch(slot)
        busy = np.zeros(self.capacity, dtype=bool)
        busy[[slot for _, slot in hits]] = True
        victims = self._victims(~busy, len(missing))
        admitted = list(zip(missing[: len(victims)], victims))
        for slot in victims:
            old = self.expert_of_slot[slot]
            if old >= 0:
                self.slot_of_expert[old] = -1
            self.expert_of_slot[slot] = -1  # empty until its new expert has been read
        return PassPlan(hits, admitted, missing[len(victims):])

    def commit(self, admitted: list[tuple[int, int]]) -> None:
        """The admitted experts' reads completed: they are resident from now on."""
        for expert, slot in admitted:
            self.expert_of_slot[slot] = expert
            self.slot_of_expert[expert] = slot
            self.uses[slot] = 0
            self._touch(slot)

    def abort(self, admitted: list[tuple[int, int]]) -> None:
        """A read failed: the admitted slots stay empty (they were emptied by `plan`)."""
        for _, slot in admitted:
            self.expert_of_slot[slot] = -1

    def clear(self) -> None:
        """A cold start: nothing resident and no usage history, so what a pass evicts next depends on
        nothing that ran before (bench methods each start from this same state)."""
        self.expert_of_slot[:] = -1
        self.slot_of_expert[:] = -1
        self.last_used[:] = 0
        self.uses[:] = 0
        self._clock = 0

    def _touch(self, slot: int) -> None:
        self.last_used[slot] = self._clock
        self.uses[slot] += 1

    def _victims(self, free: np.ndarray, count: int) -> list[int]:
        """Up to `count` slots among `free` ([C] bool), empty ones first, then by the eviction order."""
        candidates = np.flatnonzero(free)
        if count <= 0 or not len(candidates):
            return []
        empty = self.expert_of_slot[candidates] < 0
        if self.eviction is Eviction.LFU:
            order = np.lexsort((self.last_used[candidates], self.uses[candidates], ~empty))
        else:
            order = np.lexsort((self.last_used[candidates], ~empty))
        return [int(s) for s in candidates[order[:count]]]
