"""What a generation measured, per step and in total.

Convention: the accepted length of a step counts the tokens it produced, i.e. the accepted
drafted tokens plus the bonus token, so plain autoregressive decoding has accepted length 1.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class StepStats:
    tree_size: int  # drafted nodes verified (root excluded)
    accepted_length: int  # tokens produced: accepted drafts + the bonus token
    verify_ms: float
    draft_ms: float
    unique_experts_per_layer: tuple[int, ...]  # distinct experts per MoE layer in the verify pass
    rows: int = 1  # sequences verified together in this pass (tree_size and accepted_length sum over them)
    verified_tokens: int = 0  # tokens in the verify pass, padding included
    plan_ms: float = 0.0  # the controller's plan (which nodes to verify, the next candidate budget)
    overhead_ms: float = 0.0  # engine time after the verify pass: acceptance, cache compaction, drafter commit, observe
    cache_columns: int = 0  # cached columns the pass attended over: committed tokens, left filler, stale tree columns
    expert_hits: int = 0  # offloaded experts only: (layer, expert) the pass found resident
    expert_misses: int = 0  # ... and had to read from the slow tier
    bytes_read: int = 0
    fetch_wait_ms: float = 0.0  # verify time spent waiting on reads


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_ms: float = 0.0
    total_ms: float = 0.0
    steps: list[StepStats] = field(default_factory=list)
    new_tokens_per_row: list[int] = field(default_factory=list)

    @property
    def decode_ms(self) -> float:
        return self.total_ms - self.prefill_ms

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second over the whole call, prefill included."""
        return 1000.0 * self.new_tokens / self.total_ms if self.total_ms > 0 else 0.0

    @property
    def mean_accept_len(self) -> float:
        """Tokens produced per row per step (the bonus token included)."""
        if not self.steps:
            return 0.0
        return sum(s.accepted_length for s in self.steps) / sum(s.rows for s in self.steps)

    @property
    def verify_ms(self) -> float:
        return sum(s.verify_ms for s in self.steps)

    @property
    def draft_ms(self) -> float:
        return sum(s.draft_ms for s in self.steps)

    @property
    def plan_ms(self) -> float:
        return sum(s.plan_ms for s in self.steps)

    @property
    def mean_tree_size(self) -> float:
        """Drafted nodes verified per row per step."""
        return sum(s.tree_size for s in self.steps) / sum(s.rows for s in self.steps) if self.steps else 0.0

    @property
    def unique_experts_per_layer(self) -> float:
        """Mean over verify passes of the distinct experts per MoE layer."""
        per_step = [sum(s.unique_experts_per_layer) / len(s.unique_experts_per_layer) for s in self.steps if s.unique_experts_per_layer]
        return sum(per_step) / len(per_step) if per_step else 0.0

    @property
    def expert_loads_per_token(self) -> float:
        """Unique experts summed over layers per verify pass, divided by the tokens produced."""
        produced = sum(s.accepted_length for s in self.steps)
        loads = sum(sum(s.unique_experts_per_layer) for s in self.steps)
        return loads / produced if produced else 0.0

    @property
    def misses_per_token(self) -> float:
        """Experts read from the slow tier per token produced (0 when nothing is offloaded)."""
        produced = sum(s.accepted_length for s in self.steps)
        return sum(s.expert_misses for s in self.steps) / produced if produced else 0.0

    @property
    def bytes_read_per_token(self) -> float:
        produced = sum(s.accepted_length for s in self.steps)
        return sum(s.bytes_read for s in self.steps) / produced if produced else 0.0

    @property
    def hit_rate(self) -> float:
        """Share of the (layer, expert) a pass needed that were resident (nan when nothing is offloaded)."""
        hits = sum(s.expert_hits for s in self.steps)
        total = hits + sum(s.expert_misses for s in self.steps)
        return hits / total if total else float("nan")

    def summary(self) -> dict:
        return {
            "new_tokens": self.new_tokens,
            "steps": len(self.steps),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "mean_accept_len": round(self.mean_accept_len, 4),
            "mean_tree_size": round(self.mean_tree_size, 3),
            "verify_ms": round(self.verify_ms, 3),
            "draft_ms": round(self.draft_ms, 3),
            "plan_ms": round(self.plan_ms, 3),
            "prefill_ms": round(self.prefill_ms, 3),
            "total_ms": round(self.total_ms, 3),
            "unique_experts_per_layer": round(self.unique_experts_per_layer, 3),
            "expert_loads_per_token": round(self.expert_loads_per_token, 3),
            "misses_per_token": round(self.misses_per_token, 3),
            "bytes_read_per_token": round(self.bytes_read_per_token, 1),
            "hit_rate": round(self.hit_rate, 4) if self.hit_rate == self.hit_rate else None,
        }

    def to_dict(self) -> dict:
        return {**self.summary(), "per_step": [asdict(s) for s in self.steps]}
