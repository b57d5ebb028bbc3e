"""How long a chain of sampled candidates to draft: from the acceptance chains reach per depth.

A sampled chain is verified whole (a cut that looks at what was drawn biases the output), so its
only decision is its length L, made before anything is drawn. A chain of L nodes produces on
average 1 + sum_{d <= L} R_d tokens, R_d = prod_{i <= d} a_i the chance its depth-d node is
reached and accepted, a_d = P(the depth-d node is accepted | its parent was); it costs the draft
time of L nodes plus the verify time of L + 1 tokens. `best_chain_length` takes the L of best
tokens per ms, L = 0 being a plain step.

The a_d are what chains are *measured* to reach, not what the last chain's draws were calibrated
at: the profile's per-depth means from chains decoded at the request's setting (`SettingAcceptance.
chain_conditional`) as a prior, then every verified chain's exact acceptance probabilities
(`Acceptance.trials`, min(1, p(x) / q(x)) of each node whose parent was reached). Sizing from the
last chain's calibrated values instead (what `moe-aware` did before) let one chain's noise set the
next chain's length, which wandered between 2 and 5 nodes and averaged 2.8 where fixed chains of 4
paid most (T = 0.7 top-p 0.9, 16 shipped prompts: 1.40x ar against 1.58x for a chain of 4).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass
class ChainAcceptance:
    """a_d per depth: the profile's figure worth `prior_steps` observed nodes, then the observed
    nodes' exact acceptance probabilities. Depths past the profile's are priced at its deepest
    figure."""

    prior: tuple[float, ...]  # a_1..a_D measured by the profile (D >= 1)
    prior_steps: float = 4.0
    sums: dict[int, float] = field(default_factory=dict)
    counts: dict[int, int] = field(default_factory=dict)

    def __post_init__(self):
        if not self.prior or not all(0.0 <= a <= 1.0 for a in self.prior):
            raise ValueError(f"a chain prior needs per-depth probabilities in [0, 1], got {self.prior}")
        if self.prior_steps <= 0:
            raise ValueError(f"prior_steps must be > 0, got {self.prior_steps}")

    def observe(self, depth_probabilities: Sequence[tuple[int, float]]) -> None:
        """(depth, P(accepted | parent reached)) of the nodes of a verified chain whose parent was reached."""
        for depth, probability in depth_probabilities:
            self.sums[depth] = self.sums.get(depth, 0.0) + probability
            self.counts[depth] = self.counts.get(depth, 0) + 1

    def conditional(self, depth: int) -> float:
        prior = self.prior[min(depth, len(self.prior)) - 1]
        return (self.prior_steps * prior + self.sums.get(depth, 0.0)) / (self.prior_steps + self.counts.get(depth, 0))

    def reach(self, depths: int) -> list[float]:
        """[R_1..R_depths]: the chance each depth's node is accepted, its ancestors' chances included."""
        reach, product = [], 1.0
        for depth in range(1, depths + 1):
            product *= self.conditional(depth)
            reach.append(product)
        return reach


def best_chain_length(reach: Sequence[float], step_ms: Callable[[int], float], rows: int = 1) -> tuple[int, float]:
    """(L, tokens per ms) of the chain length of best throughput, L in 0..len(reach) (0: a plain
    step), each of `rows` rows drafting a chain of L: rows * (1 + R_1 + ... + R_L) / step_ms(L),
    `step_ms(L)` the draft and verify time of the step (the verify time alone at L = 0)."""
    best, best_rate, value = 0, rows / max(step_ms(0), 1e-9), float(rows)
    for length in range(1, len(reach) + 1):
        value += rows * reach[length - 1]
        rate = value / max(step_ms(length), 1e-9)
        if rate > best_rate:
            best, best_rate = length, rate
    return best, best_rate
