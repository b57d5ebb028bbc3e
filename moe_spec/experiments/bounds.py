"""Upper bounds on what any node-selection policy could reach on recorded steps (replays, not
measurements).

The *selection ceiling*: on each traced step, a policy verifies some connected subtree S of the
candidate tree and produces 1 + (accepted drafts in S) tokens, at the replay's price t(S) = draft +
verify(|S|, U(S)) with U from the recorded routing. A policy whose S yields k drafted tokens must
contain the first k nodes of the accepted path, and verify() grows with both the token count and
the expert union, so no S beats the accepted path's own prefix of length k. The best any policy can
do over a whole trace is then

    max over k_s in 0..len(path_s) - 1 of  sum_s (k_s + 1) / sum_s t_s(prefix_{k_s}),

a ratio of sums, maximised exactly by Dinkelbach's iteration: for a rate lambda pick, per step, the
k maximising (k + 1) - lambda * t(k); set lambda to the ratio of that choice; repeat until it stops
rising (it rises strictly until optimal, over finitely many choices).

Exact for greedy traces (acceptance replayed from the recorded argmax). For a sampled trace the
accepted path is the one sampled; the ceiling is then that of the recorded randomness.
"""

from __future__ import annotations

from collections.abc import Sequence

from moe_spec.core.step_record import StepRecord
from moe_spec.profile.cost_model import CostModel


def path_prefix_options(step: StepRecord, cost: CostModel, draft_ms: float, unique_experts) -> list[tuple[int, float, tuple[int, ...]]]:
    """Per number of accepted drafts k = 0..: (tokens k + 1, draft + verify ms of the path's first
    k + 1 nodes, those nodes)."""
    path = list(step.acceptances[0].path)
    options = []
    for k in range(len(path)):
        keep = tuple(path[: k + 1])
        options.append((k + 1, draft_ms + cost.predict_ms(len(keep), unique_experts(step, keep)), keep))
    return options


def selection_ceiling(options_per_step: Sequence[list[tuple[int, float, tuple[int, ...]]]]) -> list[int]:
    """Dinkelbach's iteration over per-step options (tokens, ms, nodes): the option index chosen on
    each step by the throughput-maximising choice of the whole trace."""
    choice = [len(options) - 1 for options in options_per_step]  # start from the whole accepted path

    def rate(picks: list[int]) -> float:
        tokens = sum(options[i][0] for options, i in zip(options_per_step, picks))
        ms = sum(options[i][1] for options, i in zip(options_per_step, picks))
        return tokens / ms if ms > 0 else float("inf")

    current = rate(choice)
    while True:
        better = [max(range(len(options)), key=lambda i: (options[i][0] - current * options[i][1], -i))
                  for options in options_per_step]
        new = rate(better)
        if new <= current * (1 + 1e-12):
            return choice if rate(choice) >= new else better
        choice, current = better, new
