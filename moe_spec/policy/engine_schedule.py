"""How many tokens an engine that verifies chains should speculate, per batch size: vLLM's
`num_speculative_tokens` and `num_speculative_tokens_per_batch_size`, priced by this target's cost.

An engine such as vLLM drafts a chain of K tokens per request and verifies every request's K + 1
tokens in one pass. On an MoE target that pass loads the union of the experts all B x (K + 1) tokens
route to, so the K that pays shrinks as the batch grows: more rows already touch most experts, and
every extra draft token is one more token of compute for every row. Here:

- tokens a step makes: B (1 + R_1 + ... + R_K), R_d the chance a chain's first d drafts are all
  accepted, measured by decoding with the head (`moe_spec.measure.chain_reach`);
- time a step takes: the draft (the profile's measured draft cost: a part per depth and per node)
  plus the verify pass, `CostModel.predict_ms(B (K + 1) tokens, U, rows=B)`, U[l] the experts the
  batch's tokens route to in layer l: each row's K + 1 tokens activate u_l = the profile's measured
  unique-experts curve at K + 1 tokens, and B rows that route independently cover
  E (1 - (1 - u_l / E)^B) of the layer's E experts;
- K(B) = the chain length of most tokens per ms (`chain_sizing.best_chain_length`), 0 where
  speculating does not pay at all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from moe_spec.policy.chain_sizing import best_chain_length
from moe_spec.profile.artifact import Profile


@dataclass(frozen=True)
class BatchChoice:
    rows: int  # B, requests verified together
    length: int  # K, draft tokens per request (0: no speculation)
    tokens_per_step: float  # B (1 + R_1 + ... + R_K)
    step_ms: float  # predicted draft + verify time of such a step
    rates: tuple[float, ...]  # tokens per ms for K = 0..K_max, the alternatives weighed

    @property
    def speedup(self) -> float:
        """Predicted tokens per ms against not speculating at this batch size."""
        return self.rates[self.length] / self.rates[0]


def union_experts(profile: Profile, rows: int, tokens_per_row: int) -> np.ndarray:
    """[L] expected distinct experts per MoE layer that `rows` independent rows of `tokens_per_row`
    consecutive tokens activate (each row's from the profile's unique-experts curve); a dense target
    has none to load."""
    curve = profile.unique_experts_curve
    if curve is None:
        return np.zeros(profile.cost_model.num_layers)
    experts = float(profile.num_experts)
    per_row = np.minimum(curve.real_at(tokens_per_row), experts)
    return experts * (1.0 - (1.0 - per_row / experts) ** rows)


def draft_ms(profile: Profile, rows: int, length: int) -> float:
    """The profile's measured draft time of `rows` chains of `length` nodes (one head forward per depth)."""
    if length == 0:
        return 0.0
    base, per_depth, per_node = profile.draft_cost
    return max(base + per_depth * length + per_node * rows * length, 0.0)


def step_ms(profile: Profile, rows: int, length: int) -> float:
    """Predicted time of a step of `rows` requests each verifying a chain of `length` drafts."""
    tokens = length + 1
    verify = profile.cost_model.predict_ms(rows * tokens, union_experts(profile, rows, tokens), rows=rows)
    return draft_ms(profile, rows, length) + verify


StepCost = Callable[[int, int], float]  # (rows, chain length) -> ms of such a step


def choose(profile: Profile, reach: Sequence[float], rows: int, step_cost: StepCost | None = None) -> BatchChoice:
    """The chain length of most tokens per ms for a batch of `rows`, K in 0..len(reach), each step
    priced by `step_cost` (default: `step_ms`, the profile's prices; an engine's own measured step
    times: `moe_spec.integrations.vllm.step_costs`)."""
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    price = step_cost or (lambda rows_, length: step_ms(profile, rows_, length))
    costs = [price(rows, k) for k in range(len(reach) + 1)]
    length, _ = best_chain_length(reach, lambda k: costs[k], rows)
    values = np.cumsum([rows] + [rows * r for r in reach])  # tokens per step for K = 0..K_max
    rates = tuple(float(v / max(c, 1e-9)) for v, c in zip(values, costs))
    return BatchChoice(rows, length, float(values[length]), costs[length], rates)


def schedule(profile: Profile, reach: Sequence[float], max_rows: int, step_cost: StepCost | None = None) -> list[BatchChoice]:
    """`choose` for every batch size 1..max_rows."""
    if not reach:
        raise ValueError("reach must give the acceptance of at least one draft depth")
    return [choose(profile, reach, rows, step_cost) for rows in range(1, max_rows + 1)]


def vllm_ranges(choices: Sequence[BatchChoice]) -> list[list[int]]:
    """vLLM's `num_speculative_tokens_per_batch_size`: [start, end, K] over inclusive batch-size ranges,
    consecutive sizes of one K merged, starting at 1 (the last range covers every larger batch)."""
    ranges: list[list[int]] = []
    for choice in sorted(choices, key=lambda c: c.rows):
        if ranges and ranges[-1][2] == choice.length and ranges[-1][1] == choice.rows - 1:
            ranges[-1][1] = choice.rows
        else:
            ranges.append([choice.rows, choice.rows, choice.length])
    if not ranges or ranges[0][0] != 1:
        raise ValueError("a schedule must start at batch size 1")
    return ranges
