"""Upper bounds and oracles on recorded steps, and the gap decomposition they give (replays, not
measurements).

(a) The *selection ceiling*: on each traced step, a policy verifies some connected subtree S of the
candidate tree and produces 1 + (accepted drafts in S) tokens, at the replay's price t(S) = draft +
verify(|S|, U(S)) with U from the recorded routing. A policy whose S yields k drafted tokens must
contain the first k nodes of the accepted path, and verify() grows with both the token count and
the expert union, so no S beats the accepted path's own prefix of length k. The best any policy can
do over a whole trace is then

    max over k_s in 0..len(path_s) - 1 of  sum_s (k_s + 1) / sum_s t_s(prefix_{k_s}),

a ratio of sums, maximised exactly by Dinkelbach's iteration: for a rate lambda pick, per step, the
k maximising (k + 1) - lambda * t(k); set lambda to the ratio of that choice; repeat until it stops
rising (it rises strictly until optimal, over finitely many choices). `ceiling (bound)` charges every
step the replay's draft time (EAGLE-2 drafting its whole candidate tree), as every replayed policy
pays; `ceiling, sized draft (bound)` charges each prefix the draft time of its own size
(`sized_draft_ms`, none when nothing is drafted), which bounds every sized-draft row below, since the
sized draft time grows with a subtree's depth and node count and S reaches at least depth k with at
least k nodes. With experts offloaded behind a cache, a step's price depends on what the steps
before it loaded, the sum no longer separates, and the same iteration choosing step by step given
the cache (`replay.cached_selection`) is a heuristic: a ceiling of these choices, not of every one.

(b) `moe-aware, true routing`: the controller prices each node by the experts the trace recorded
for it (`OracleMoeAware` overriding `ProfiledController._expert_probs`) instead of the profile's
prediction. Its price of the set it picks is then the replay's exactly, but it is not a bound:
best-first growth is a heuristic, its values are calibrated expectations rather than what was
accepted, and it maximises each step's own ratio rather than the trace's ratio of sums, so exact
prices can pick a worse set than a prediction error that happened to cancel a calibration error.
It reads as "what routing-prediction error costs", and may come out below 1.

(c) `moe-aware, sized draft (bound)`: moe-aware's choices, each step charged the draft time of the
subtree it verified (`sized_draft_ms`) instead of EAGLE-2's full candidate tree: what drafting a
candidate tree larger than the one verified costs. A replay has no controller time at all (plan_ms
is not charged to any replayed policy), so this is also moe-aware with zero controller time. Same
tokens, same verify time, no more draft time: never below moe-aware's replay, step by step.

`moe-aware, realised acceptance`: the controller's node values are the recorded outcome (1 on the
accepted path, 0 elsewhere) instead of the calibration: what calibration error costs. `moe-aware,
all oracles` has true routing, realised acceptance and the sized draft together; what separates it
from the sized ceiling is selection itself (greedy growth per step, the controller's linear
draft-depth price, the per-step rather than whole-trace ratio).

Exact for greedy traces (acceptance replayed from the recorded argmax). For a sampled trace the
accepted path is the one sampled; the bounds are then those of the recorded randomness.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from moe_spec.core.forest import StepForest
from moe_spec.core.step_record import StepRecord
from moe_spec.measure.latency import DraftCost
from moe_spec.policy.moe_aware import MoeAwareController

CEILING = "ceiling (bound)"  # (a)
SIZED_CEILING = "ceiling, sized draft (bound)"
SIZED_DRAFT = "moe-aware, sized draft (bound)"  # (c)
TRUE_ROUTING = "moe-aware, true routing (oracle)"  # (b)
REALISED = "moe-aware, realised acceptance (oracle)"
ALL_ORACLES = "moe-aware, all oracles (oracle)"
STATIC_SIZED = "static-best, sized draft (bound)"


def path_prefix_options(step: StepRecord, step_ms: Callable[[tuple[int, ...]], float]
                        ) -> list[tuple[int, float, tuple[int, ...]]]:
    """Per number of accepted drafts k = 0..: (tokens k + 1, `step_ms` of the path's first k + 1
    nodes, those nodes); `step_ms(nodes)` is what drafting and verifying `nodes` is charged."""
    path = list(step.acceptances[0].path)
    return [(k + 1, step_ms(tuple(path[: k + 1])), tuple(path[: k + 1])) for k in range(len(path))]


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


def profiled_draft_cost(profile) -> DraftCost | None:
    """The drafter's measured draft-time formula the profiler stored (None: the profile has none)."""
    section = profile.details.get("draft_cost")
    if not section:
        return None
    return DraftCost(float(section["base_ms"]), float(section["per_depth_ms"]), float(section["per_node_ms"]), ())


def sized_draft_ms(step: StepRecord, keep: Sequence[int], full_ms: float, draft_cost: DraftCost | None) -> float:
    """The draft time of a candidate tree the size of subtree `keep` (its depth and drafted nodes),
    from `full_ms`, what drafting the step's candidate tree cost: `full_ms` times the ratio of the
    drafter's measured formula at the two sizes (clamped at 0), or of the two depths without one.
    Zero when `keep` drafts nothing. Non-decreasing in depth and nodes, at most `full_ms` for a
    subtree of the candidates."""
    keep = list(keep)
    depth = int(step.tree().depths[keep].max())
    if depth == 0 or full_ms <= 0:
        return 0.0
    candidates = step.candidates[0]
    full_depth, full_nodes = int(candidates.depths.max()), candidates.num_drafted
    if draft_cost is not None:
        full = max(draft_cost.predict_ms(full_depth, full_nodes), 0.0)
        if full > 0:
            return full_ms * min(max(draft_cost.predict_ms(depth, len(keep) - 1), 0.0) / full, 1.0)
    return full_ms * min(depth / full_depth, 1.0)


class OracleMoeAware(MoeAwareController):
    """`moe-aware` told, before each `plan`, what the trace recorded for the step (`reveal`): with
    `true_routing`, each node is priced by its recorded experts (0/1 over E, exact union counts);
    with `realised_acceptance`, each node's value is 1 on the recorded accepted path and 0 off it.
    Online corrections off, as for every replayed policy."""

    def __init__(self, profile, true_routing: bool, realised_acceptance: bool, residency=None):
        super().__init__(profile, adapt=False, residency=residency)
        self.true_routing = true_routing
        self.realised_acceptance = realised_acceptance
        self._step: StepRecord | None = None

    def reveal(self, step: StepRecord) -> None:
        """The step the next `plan` is called on (its verified tree is the candidates planned from)."""
        self._step = step

    def _recorded(self, forest: StepForest) -> StepRecord:
        step = self._step
        if step is None or forest.rows != 1 or len(forest[0]) != len(step.tree()):
            raise ValueError("OracleMoeAware plans only the one-row step last revealed")
        return step

    def _expert_probs(self, forest: StepForest) -> torch.Tensor | None:
        if not self.true_routing or not self.profile.cost_model.num_layers:
            return super()._expert_probs(forest)
        step = self._recorded(forest)
        experts = step.experts()  # [L, N, K]
        return torch.nn.functional.one_hot(experts, step.routing.num_experts).amax(2).float()  # [L, N, E]

    def _value_rows(self, forest: StepForest) -> list[list[float]]:
        # the one source of node values: the sizing grows from these, `values_of` reads them
        if not self.realised_acceptance:
            return super()._value_rows(forest)
        return [[float(v) for v in self._recorded(StepForest.of(forest)).on_path().tolist()]]  # [N], root 1


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return round(numerator / denominator, 4)


def decomposition(figures: dict[str, dict]) -> dict:
    """The gap from `moe-aware` and `static-best` to the bounds, as ratios of replayed throughputs
    on the same steps (> 1: what removing that cause alone would gain); see the module docstring.

    For moe-aware, drafting x routing x calibration x interaction = all oracles / moe-aware, and
    that times the remaining (selection) factor = the total gap to the sized ceiling."""
    rate = {name: f["tokens_per_s"] for name, f in figures.items()}
    parts: dict = {}
    if "moe-aware" in rate and ALL_ORACLES in rate:
        m = rate["moe-aware"]
        single = {"drafting": _ratio(rate[SIZED_DRAFT], m), "routing": _ratio(rate[TRUE_ROUTING], m),
                  "calibration": _ratio(rate[REALISED], m)}
        together = _ratio(rate[ALL_ORACLES], m)
        known = None not in single.values() and together is not None
        product = single["drafting"] * single["routing"] * single["calibration"] if known else None
        parts["moe-aware"] = {
            "tokens_per_s": m, **single,
            "interaction": _ratio(together, product) if known else None,
            "all_oracles": together,
            "remaining_selection": _ratio(rate[SIZED_CEILING], rate[ALL_ORACLES]),
            "total_to_sized_ceiling": _ratio(rate[SIZED_CEILING], m),
            "to_ceiling": _ratio(rate[CEILING], m),
            "predicted_accept_len": figures["moe-aware"].get("predicted_accept_len"),
            "realised_accept_len": figures["moe-aware"]["mean_accept_len"],
        }
    if "static-best" in rate and STATIC_SIZED in rate:
        s = rate["static-best"]
        parts["static-best"] = {
            "tokens_per_s": s, "budget": figures["static-best"].get("budget"),
            "drafting": _ratio(rate[STATIC_SIZED], s), "routing": None, "calibration": None, "interaction": None,
            "all_oracles": _ratio(rate[STATIC_SIZED], s),
            "remaining_selection": _ratio(rate[SIZED_CEILING], rate[STATIC_SIZED]),
            "total_to_sized_ceiling": _ratio(rate[SIZED_CEILING], s),
            "to_ceiling": _ratio(rate[CEILING], s),
        }
    return parts
