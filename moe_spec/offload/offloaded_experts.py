"""Routed experts served from a slow tier through a resident cache, as a transformers experts implementation.

    offload = offload_experts(model, OffloadConfig(tier="disk", folder="runs/store", resident=16))
    SpecDecoder(model, drafter, controller, offload=offload).generate(...)

`offload_experts` writes (or reopens) the model's expert store, gives every MoE layer a
`LayerCache` of `resident` slots, frees the routed experts' weights (accelerate's
`set_module_tensor_to_device(..., "meta")`, as its own offloading does), and registers one experts
implementation in transformers' `ExpertsInterface` that the model is switched to. Shared experts,
routers, attention and embeddings stay where they are.

Each experts call (one MoE layer of one forward) then:
1. lists the distinct experts its tokens route to and asks the layer cache for hits, admissions
   (read now, kept) and overflow (more experts than `resident`: read through scratch slots);
2. reads the admitted experts, all together (parallel, see `expert_fetch.py`);
3. when every needed expert sits in a slot (no overflow), runs transformers' `grouped_mm` once on
   the slots, each expert id replaced by its slot: the same group matmuls on the same rows and the
   kernel's own sum over k, so the output is the reference's bit for bit;
4. otherwise computes the (token, k) rows chunk by chunk (the overflow streamed, double-buffered,
   through the scratch slots) and combines them exactly as the replaced implementation would.

Lossless by construction: in step 4 every (token, k) row is computed by transformers' own
implementation (the one the model ran before: `grouped_mm`, or the model's `eager` loop), called on a
view of the experts module whose weights are the slots and with each pair as a one-expert token, so
the row is the same group matmul on the same inputs; the rows are then summed over k in (token, k)
order as `grouped_mm` does, or accumulated expert by expert in ascending id as `eager` does (which
is why `eager` always takes step 4). Greedy output is token-identical and sampling draws identical
for every C, batch and policy (tested per architecture). Other implementations (`batched_mm`,
`megablocks`) are served as `grouped_mm`.

Whole-layer fetching (`cache="whole-layer"`: every pass reads all experts of each layer, as
module-granular offloading does) and no cache (`resident=0`: every pass reads each expert it uses)
are the peers the resident cache is measured against.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from torch import nn

from moe_spec.core.routing import find_routers
from moe_spec.errors import InputError
from moe_spec.offload.expert_fetch import DiskFetcher, HostFetcher
from moe_spec.offload.expert_store import FILE_NAME, ExpertStore, expert_params, find_experts, write_store
from moe_spec.offload.resident_cache import Eviction, LayerCache
from moe_spec.profile.artifact import fingerprint
from moe_spec.profile.fetch_cost import FetchCost

TIERS = ("disk", "host")
CACHES = ("resident", "whole-layer")
_NAMES = itertools.count()


def reading_label(layer_ahead: bool) -> str:
    """How a pass reads its experts: "a layer ahead" (`OffloadConfig.layer_ahead`) or "on demand"."""
    return "a layer ahead" if layer_ahead else "on demand"


@dataclass(frozen=True)
class OffloadConfig:
    folder: str | Path  # where the expert store lives (written there once)
    tier: str = "disk"  # disk: the store file, read with O_DIRECT; host: pinned host memory (CUDA)
    resident: int = 16  # experts per MoE layer kept in fast memory (C); 0: no cache
    cache: str = "resident"  # or "whole-layer": every pass reads all of a layer's experts
    eviction: Eviction = Eviction.LRU
    scratch: int | None = None  # slots a pass streams overflow through; default 2 * top-k
    workers: int = 4  # parallel reads
    verify_reads: bool = False  # check every block's CRC-32 as it is read
    # read the experts a plan expects while earlier layers compute (`ExpertOffload.prefetch`)
    prefetch: bool = False
    # while a MoE layer waits for and computes its experts, read those the next MoE layer's router
    # picks for this layer's hidden states (pre-gating): its misses then arrive while this layer
    # computes (`ExpertOffload._read_next_layer`)
    layer_ahead: bool = False
    # both off by default: on the 2-core CPU they were measured on, a read costs the cores about what
    # waiting for it costs, and side by side with reading on demand they ran 0.93-1.00x and
    # 0.89-0.98x (docs/offload.md)

    def __post_init__(self):
        if self.tier not in TIERS:
            raise InputError(f"offload tier must be one of {TIERS}, got {self.tier!r}")
        if self.cache not in CACHES:
            raise InputError(f"offload cache must be one of {CACHES}, got {self.cache!r}")
        if not isinstance(self.resident, int) or self.resident < 0:
            raise InputError(f"resident experts must be an integer >= 0, got {self.resident!r}")
        if self.scratch is not None and self.scratch < 1:
            raise InputError(f"scratch slots must be >= 1, got {self.scratch}")
        if self.workers < 1:
            raise InputError(f"offload workers must be >= 1, got {self.workers}")
        object.__setattr__(self, "eviction", Eviction(self.eviction))

    @property
    def reading(self) -> str:
        """How a pass reads its experts, as the fetch stage's report names it (`reading_label`)."""
        return reading_label(self.layer_ahead)

    def describe(self) -> str:
        if self.cache == "whole-layer":
            return f"{self.tier}, whole-layer fetching"
        if self.resident == 0:
            return f"{self.tier}, no cache"
        ahead = (", read ahead" if self.prefetch else "") + (", layer ahead" if self.layer_ahead else "")
        return f"{self.tier}, {self.resident} resident, {self.eviction.value}{ahead}"


@dataclass
class OffloadCounters:
    """Cumulative counts over experts calls (one per MoE layer per forward)."""

    calls: int = 0
    hits: int = 0  # (layer, expert) a pass needed and found resident
    misses: int = 0  # (layer, expert) a pass read: needed and not resident, or read ahead for it (prefetch)
    bytes_read: int = 0
    wait_ms: float = 0.0  # time the forward waited on reads (what compute did not hide)
    per_layer_misses: list[int] = field(default_factory=list)
    read_ahead: int = 0  # (layer, expert) read ahead of a pass (`ExpertOffload.prefetch`), counted in `misses`
    read_ahead_used: int = 0  # of those, the ones the pass needed

    def copy(self) -> "OffloadCounters":
        return replace(self, per_layer_misses=list(self.per_layer_misses))

    def since(self, earlier: "OffloadCounters") -> "OffloadCounters":
        return OffloadCounters(self.calls - earlier.calls, self.hits - earlier.hits, self.misses - earlier.misses,
                               self.bytes_read - earlier.bytes_read, self.wait_ms - earlier.wait_ms,
                               [a - b for a, b in zip(self.per_layer_misses, earlier.per_layer_misses)],
                               self.read_ahead - earlier.read_ahead, self.read_ahead_used - earlier.read_ahead_used)


class _SlotView:
    """An experts module seen with the layer's slots as its expert weights (and as many "experts" as
    slots): what transformers' experts implementations read, nothing set on the module itself."""

    def __init__(self, module: nn.Module, tensors: dict[str, torch.Tensor], num_slots: int):
        self.__dict__.update(tensors)
        self.num_experts = num_slots
        self._module = module

    def __getattr__(self, name):
        return getattr(self._module, name)


class ExpertOffload:
    """The installed offload of one model: its caches, its fetcher and its counters."""

    def __init__(self, model: nn.Module, store: ExpertStore, config: OffloadConfig):
        experts = find_experts(model)
        self.config = config
        self.store = store
        self.layers = tuple(e.layer for e in experts)
        self.num_experts = store.layout.num_experts
        self.top_k = int(getattr(model.config, "num_experts_per_tok", 0) or 0) or None
        device = next(p.device for _, p in expert_params(experts[0].module))
        self.device = device
        names = [p.name for p in store.layout.params]
        base = getattr(model.config, "_experts_implementation", "grouped_mm")
        self.base = "eager" if base == "eager" else "grouped_mm"
        whole = config.cache == "whole-layer"
        capacity = 0 if whole else min(config.resident, self.num_experts)
        if not whole and 0 < capacity < (self.top_k or 1):
            raise InputError(f"resident experts ({capacity}) must be at least top-k ({self.top_k}) or 0 (no cache)")
        # a pass never needs more than E - C scratch slots (C >= E: none, beyond one to keep the slot tensors whole)
        scratch = self.num_experts if whole else max(1, min(config.scratch or 2 * (self.top_k or 1), self.num_experts - capacity))
        dtype = store.layout.torch_dtype
        self.caches = [LayerCache(self.num_experts, capacity, scratch, [p.shape for p in store.layout.params], dtype,
                                  device, config.eviction) for _ in experts]
        self._position = {id(e.module): i for i, e in enumerate(experts)}
        self._views = [_SlotView(e.module, dict(zip(names, cache.slots)), capacity + scratch)
                       for e, cache in zip(experts, self.caches)]
        self._eager = [type(e.module).forward.__wrapped__ for e in experts] if self.base == "eager" else None
        if config.tier == "host":
            host = [[p.detach().cpu().clone() for _, p in expert_params(e.module)] for e in experts]
            self.fetcher = HostFetcher(host, device)
        else:
            self.fetcher = DiskFetcher(store, config.workers, config.verify_reads)
        self.counters = OffloadCounters(per_layer_misses=[0] * len(experts))
        self._ahead: dict[int, tuple[list[tuple[int, int]], object]] = {}  # layer -> (admitted, PendingReads) in flight
        # position -> the router of the MoE layer after it (the last: None), for `layer_ahead`
        # (found whether or not this config reads ahead: a later config may; refused now if this one does)
        self._next_router = _next_routers(model, self.layers, required=config.layer_ahead)
        self.model_fingerprint: dict | None = None  # the model's `fingerprint` before its experts left (profiles match it)
        self.implementation: str | None = None  # the name registered in transformers' ExpertsInterface
        self.full_bytes = len(experts) * self.num_experts * store.layout.payload_bytes
        self.resident_bytes = len(experts) * capacity * store.layout.payload_bytes  # the cache proper
        self.scratch_bytes = len(experts) * scratch * store.layout.payload_bytes  # streaming slots beside it

    # ---- what the rest of moe_spec reads -------------------------------------------------------
    @property
    def capacity(self) -> int | None:
        """Resident slots per MoE layer, beyond which a pass streams its experts through scratch
        slots (None: whole-layer fetching, where every pass reads every expert)."""
        return None if self.config.cache == "whole-layer" else self.config.resident

    def residency(self) -> torch.Tensor:
        """[L, E] bool: the experts of each MoE layer in fast memory now (exact, read at decision time)."""
        return torch.from_numpy(np.stack([cache.resident for cache in self.caches]))

    def summary(self) -> dict:
        return {"offload": self.config.describe(), "store": str(self.store.path), "direct_reads": self.store.direct,
                "resident_mb": round(self.resident_bytes / 2**20, 3), "scratch_mb": round(self.scratch_bytes / 2**20, 3),
                "experts_mb": round(self.full_bytes / 2**20, 3),
                "base_implementation": self.base}

    def measure_fetch_cost(self, counts: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64), repeats: int = 5,
                           seed: int = 0) -> FetchCost:
        """m_l(M): the median ms of fetching M random experts of each layer in one go, as a pass does
        (parallel reads into slots), for M in `counts` (up to the layer's experts). Reads go into
        temporary slots, so the cache's residency is untouched."""
        counts = tuple(c for c in counts if c <= self.num_experts) or (self.num_experts,)
        shapes = [p.shape for p in self.store.layout.params]
        scratch = [torch.empty((counts[-1], *shape), dtype=self.store.layout.torch_dtype, device=self.device)
                   for shape in shapes]  # [M, *shape] per expert parameter
        generator = np.random.default_rng(seed)
        rows = []
        for position in range(len(self.layers)):
            row = []
            for count in counts:
                times = []
                for _ in range(repeats):
                    experts = generator.choice(self.num_experts, size=count, replace=False)
                    start = time.perf_counter()
                    self.fetcher.fetch(position, [(int(e), i) for i, e in enumerate(experts)], scratch).wait()
                    times.append((time.perf_counter() - start) * 1000)
                row.append(float(np.median(times)))
            rows.append(tuple(row))
        return FetchCost(counts, tuple(rows), self.config.tier, self.fetcher.bytes_per_expert())

    def prefetch(self, experts_per_layer) -> int:
        """Start reading, in the background, the experts each MoE layer is expected to need in the
        next pass (`experts_per_layer`: [L] expert ids, from the plan's predicted routing) and does
        not hold; returns the reads started. Issued before the pass, they proceed while the layers
        before compute, so a layer waits only for what is left of its reads (SP-MoE, MoE-SpAc). At
        most half a layer's resident slots are given to predictions, and none with no cache or
        whole-layer fetching. Outputs are unchanged: an expert computes the same from any slot."""
        if not self.config.prefetch or self.config.cache == "whole-layer":
            return 0
        started = 0
        for position, experts in enumerate(experts_per_layer[: len(self.caches)]):
            cache = self.caches[position]
            if not cache.capacity:
                break
            self._land(position)  # an earlier prefetch of this layer lands before its slots are planned again
            resident = cache.resident
            wanted = [e for e in dict.fromkeys(int(e) for e in experts) if not resident[e]][: cache.capacity // 2]
            if not wanted:
                continue
            admitted = cache.plan(wanted).admitted  # every one a miss: no overflow within half the slots
            self._ahead[position] = (admitted, self.fetcher.fetch(position, admitted, cache.slots))
            started += len(admitted)
        return started

    def _land(self, position: int) -> tuple[set[int], float]:
        """Wait for the layer's prefetch in flight, if any, and make its experts resident; returns
        (the experts it read, ms waited). A failed read leaves its slots empty."""
        entry = self._ahead.pop(position, None)
        if entry is None:
            return set(), 0.0
        admitted, pending = entry
        cache = self.caches[position]
        try:
            wait_ms = pending.wait()
        except BaseException:
            cache.abort(admitted)
            raise
        cache.commit(admitted)
        return {expert for expert, _ in admitted}, wait_ms

    def clear(self) -> None:
        """Forget every resident expert (a cold start)."""
        for position in list(self._ahead):
            self._land(position)  # no read may still write into a slot the cold cache hands out again
        for cache in self.caches:
            cache.clear()

    def close(self) -> None:
        for position in list(self._ahead):
            try:
                self._land(position)
            except Exception:  # closing: a failed background read has nothing left to corrupt
                pass
        self.fetcher.close()
        self.store.close()

    # ---- the experts call ------------------------------------------------------------------------
    def run_layer(self, module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                  top_k_weights: torch.Tensor) -> torch.Tensor:
        """hidden_states [T, D], top_k_index [T, K], top_k_weights [T, K] -> [T, D]."""
        position = self._position[id(module)]
        cache = self.caches[position]
        ahead, ahead_ms = self._land(position)  # read for this pass while earlier layers computed
        experts_of_pairs = top_k_index.reshape(-1).cpu().numpy()  # [S = T*K] expert of each (token, k) pair
        needed = np.unique(experts_of_pairs).tolist()
        slot_of = np.full(self.num_experts, -1, dtype=np.int64)  # [E] slot each needed expert is read from
        if self.config.cache == "whole-layer":
            wait_ms = self.fetcher.fetch_layer(position, cache.slots).wait()
            slot_of[:] = cache.scratch_slot(0) + np.arange(self.num_experts)
            self._count(position, 0, self.num_experts, wait_ms)
            return self._in_one_call(position, hidden_states, top_k_index, top_k_weights, experts_of_pairs, slot_of,
                                     needed)
        plan = cache.plan(needed)
        pending = self.fetcher.fetch(position, plan.admitted, cache.slots)
        try:
            self._read_next_layer(position, hidden_states)  # queued behind this layer's own reads
        finally:  # this layer's reads land (or its slots stay empty) whatever the read ahead did
            try:
                wait_ms = pending.wait()
            except BaseException:
                cache.abort(plan.admitted)
                raise
        cache.commit(plan.admitted)
        for expert, slot in plan.hits + plan.admitted:
            slot_of[expert] = slot
        # what was read ahead counts as this pass's reads (needed or not), and its exposed wait
        used = len(ahead.intersection(needed))
        hits, misses, wait_ms = len(plan.hits) - used, plan.misses + len(ahead), wait_ms + ahead_ms
        self.counters.read_ahead += len(ahead)
        self.counters.read_ahead_used += used
        if not plan.overflow:  # every expert the pass needs is in a resident slot now
            self._count(position, hits, misses, wait_ms)
            return self._in_one_call(position, hidden_states, top_k_index, top_k_weights, experts_of_pairs, slot_of,
                                     needed)
        rows = _PairRows(self, position, hidden_states, experts_of_pairs, top_k_weights)
        rows.compute([e for e, _ in plan.hits + plan.admitted], slot_of)
        wait_ms += self._stream_overflow(position, plan.overflow, rows, slot_of)
        self._count(position, hits, misses, wait_ms)
        return rows.combine(needed)

    def _read_next_layer(self, position: int, hidden_states: torch.Tensor) -> None:
        """Start reading what the next MoE layer is expected to need: its router applied to this
        layer's hidden states [T, D] (the residual stream moves little from one layer to the next:
        on the embedded target this picks 71-80% of the next layer's experts, against 44-55% for the
        draft head's predictor in the deeper layers). The most picked missing experts are read, at
        most half the layer's slots, none where a read ahead of that layer is already in flight; the
        experts it picks that are resident are refreshed, so this read evicts none of them. Outputs
        are unchanged: an expert computes the same from any slot."""
        following = position + 1
        if (not self.config.layer_ahead or not self._next_router or following >= len(self.caches)
                or following in self._ahead or not self.caches[following].capacity):
            return
        cache = self.caches[following]
        with torch.no_grad():
            picked = self._next_router[position].forward(hidden_states)[2]  # [T, K] expert ids, hooks not run
        experts, counts = np.unique(picked.reshape(-1).cpu().numpy(), return_counts=True)
        experts = experts[np.argsort(-counts, kind="stable")].tolist()  # most picked first
        resident = cache.resident
        held = [e for e in experts if resident[e]]
        missing = [e for e in experts if not resident[e]][: cache.capacity // 2]
        if not missing:
            return
        admitted = cache.plan(held + missing).admitted
        if admitted:
            self._ahead[following] = (admitted, self.fetcher.fetch(following, admitted, cache.slots))

    def _in_one_call(self, position: int, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor, experts_of_pairs: np.ndarray, slot_of: np.ndarray,
                     needed: list[int]) -> torch.Tensor:
        """The whole call at once when every needed expert sits in a slot: transformers' grouped_mm on
        the slots with each expert id replaced by its slot. Each group is the same matmul on the same
        rows and the sum over k is the kernel's own, so the output is the reference's bit for bit.
        (`eager` accumulates in expert order, which slots do not keep: it goes row by row.)"""
        if self.base == "eager":
            rows = _PairRows(self, position, hidden_states, experts_of_pairs, top_k_weights)
            rows.compute(needed, slot_of)
            return rows.combine(needed)
        from transformers.integrations.moe import grouped_mm_experts_forward

        slots = torch.from_numpy(slot_of).to(top_k_index.device)[top_k_index]  # [T, K]
        return grouped_mm_experts_forward(self._views[position], hidden_states, slots, top_k_weights)

    def _stream_overflow(self, position: int, overflow: list[int], rows: "_PairRows", slot_of: np.ndarray) -> float:
        """Experts beyond the resident slots (a pass needing more than C): read through the scratch
        slots, double-buffered (the next chunk is read into one half while the other half computes)."""
        cache = self.caches[position]
        if not overflow:
            return 0.0
        halves = 2 if cache.scratch >= 2 else 1
        size = cache.scratch // halves
        chunks = [overflow[start: start + size] for start in range(0, len(overflow), size)]

        def start(index: int):
            jobs = [(expert, cache.scratch_slot((index % halves) * size + i)) for i, expert in enumerate(chunks[index])]
            return jobs, self.fetcher.fetch(position, jobs, cache.slots)

        wait_ms, current = 0.0, start(0)
        for index in range(len(chunks)):
            jobs, pending = current
            wait_ms += pending.wait()
            following = start(index + 1) if index + 1 < len(chunks) and halves == 2 else None
            try:
                for expert, slot in jobs:
                    slot_of[expert] = slot
                rows.compute(chunks[index], slot_of)
            except BaseException:
                if following is not None:
                    following[1].wait()  # no read may still write into a slot once the pass has failed
                raise
            if following is None and index + 1 < len(chunks):
                following = start(index + 1)
            current = following
        return wait_ms

    def _count(self, position: int, hits: int, misses: int, wait_ms: float) -> None:
        c = self.counters
        c.calls += 1
        c.hits += hits
        c.misses += misses
        c.bytes_read += misses * self.fetcher.bytes_per_expert()
        c.wait_ms += wait_ms
        c.per_layer_misses[position] += misses


class _PairRows:
    """The (token, k) rows of one experts call, computed chunk by chunk and combined once."""

    def __init__(self, offload: ExpertOffload, position: int, hidden: torch.Tensor, experts: np.ndarray,
                 weights: torch.Tensor):
        self.offload, self.position = offload, position
        self.hidden, self.top_k = hidden, weights.shape[-1]  # [T, D]
        self.experts = experts  # [S = T*K] expert of each (token, k) pair, on the host
        self.weights = weights.reshape(-1)  # [S]
        weight_dtype = offload.store.layout.torch_dtype
        # grouped_mm forms each row as (weight dtype rows) * (routing weight) before summing over k
        self.row_dtype = torch.promote_types(weight_dtype, weights.dtype) if offload.base == "grouped_mm" else hidden.dtype
        self.rows = torch.empty(len(self.experts), hidden.shape[-1], dtype=self.row_dtype, device=hidden.device)  # [S, D]

    def compute(self, experts: list[int], slot_of: np.ndarray) -> None:
        """Rows of every pair routed to `experts` (whose weights sit in slots `slot_of[e]`)."""
        if not experts:
            return
        pairs = np.flatnonzero(np.isin(self.experts, experts))  # [S_c]
        pair_index = torch.from_numpy(pairs).to(self.hidden.device)
        slots = torch.from_numpy(slot_of[self.experts[pairs]]).to(self.hidden.device)[:, None]  # [S_c, 1]
        inputs = self.hidden[pair_index // self.top_k]  # [S_c, D]: each pair as its own one-expert token
        view = self.offload._views[self.position]
        if self.offload.base == "grouped_mm":
            from transformers.integrations.moe import grouped_mm_experts_forward

            # float64 in, float64 out: the kernel casts the input to the weights' dtype (exactly), and
            # its final cast to the input's dtype then keeps each row's value exactly
            out = grouped_mm_experts_forward(view, inputs.double(), slots, self.weights[pair_index][:, None])
        else:
            out = self.offload._eager[self.position](view, inputs, slots, self.weights[pair_index][:, None])
        self.rows[pair_index] = out.to(self.row_dtype)

    def combine(self, needed: list[int]) -> torch.Tensor:
        """[T, D]: each token's K rows summed as the replaced implementation sums them."""
        num_tokens, dim = self.hidden.shape
        if self.offload.base == "grouped_mm":  # reshape + sum over k, in the rows' dtype
            return self.rows.view(num_tokens, self.top_k, dim).sum(dim=1).to(self.hidden.dtype)
        final = torch.zeros_like(self.hidden)  # eager: index_add_ expert by expert, ascending id
        tokens = torch.arange(len(self.experts), device=self.hidden.device) // self.top_k
        for expert in needed:
            pairs = torch.from_numpy(np.flatnonzero(self.experts == expert)).to(self.hidden.device)
            final.index_add_(0, tokens[pairs], self.rows[pairs])
        return final


def _next_routers(model: nn.Module, layers: tuple[int, ...], required: bool = True) -> list[nn.Module | None]:
    """[L] the router of the MoE layer after each one (the last: None), for `layer_ahead`; where
    one is not found, an `InputError` if `required`, else [] (no layer is read ahead)."""
    by_layer = {router.layer: router.module for router in find_routers(model)}
    missing = [layer for layer in layers[1:] if layer not in by_layer]
    if missing and not required:
        return []
    if missing:
        raise InputError(f"layer_ahead needs the router of every MoE layer; none found in decoder layers {missing} "
                         f"of {type(model).__name__}")
    return [by_layer[layer] for layer in layers[1:]] + [None]


def offload_experts(model: nn.Module, config: OffloadConfig) -> ExpertOffload:
    """Move `model`'s routed experts to `config.tier` behind resident caches (see the module docstring).

    The store in `config.folder` is written from the model's weights when absent, and checked
    against them when present. The model is switched to the offloaded implementation in place.
    """
    from accelerate.utils import set_module_tensor_to_device
    from transformers.integrations.moe import ExpertsInterface

    experts = find_experts(model)
    if not experts:
        raise InputError(f"{type(model).__name__} has no routed experts to offload (a dense model); drop --offload")
    if any(p.is_meta for e in experts for _, p in expert_params(e.module)):
        raise InputError("this model's experts are already offloaded")
    folder = Path(config.folder)
    if config.tier == "host" and next(model.parameters()).device.type != "cuda":
        raise InputError("offload tier 'host' needs the model on a CUDA device (on the CPU the experts already "
                         "live in host memory); use --offload disk")
    top_k = int(getattr(model.config, "num_experts_per_tok", 0) or 0)
    if config.cache == "resident" and 0 < config.resident < top_k:
        raise InputError(f"resident experts ({config.resident}, --resident-experts) must be at least the model's "
                         f"top-k ({top_k}), or 0 for no cache")
    store = ExpertStore.open(folder, model) if (folder / FILE_NAME).is_file() else write_store(model, folder)
    try:
        offload = ExpertOffload(model, store, config)
    except BaseException:
        store.close()
        raise
    from moe_spec.profile.artifact import fingerprint

    offload.model_fingerprint = fingerprint(model)  # the weights' hash needs the experts' values, read here once
    for e in experts:
        for name, _ in expert_params(e.module):
            set_module_tensor_to_device(e.module, name, "meta")

    def forward(module, hidden_states, top_k_index, top_k_weights):
        return offload.run_layer(module, hidden_states, top_k_index, top_k_weights)

    name = f"moe_spec_offload_{next(_NAMES)}"
    ExpertsInterface.register(name, forward)
    model.set_experts_implementation(name)
    offload.implementation = name
    return offload
