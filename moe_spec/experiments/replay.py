"""Replaying traced steps under a cost model: what each policy would verify, accept and pay.

For every recorded step (an EAGLE-2 candidate tree with the target's argmax and routing at each
node) and every policy:

1. the policy's own controller chooses the subtree to verify (`StaticController`,
   `TruncateController`, `MoeAwareController`, built by `moe_spec.policy.registry` as for
   `moe-spec bench`), with the
   *simulated* cost model in the profile's place: `moe-aware` keeps the profile's calibration and
   expert predictor and prices nodes with the simulated coefficients; `truncate` feeds its
   token-count curve (the profile's unique-experts curve) through the simulated model. Online
   corrections are OFF (`adapt=False`): each step is decided by the profile's prior alone, since a
   correction learnt from this machine's timings says nothing about the simulated one;
2. the accepted path is scored from the recorded argmax with `accept_greedy` on the chosen subtree,
   which is exact for a greedy trace (a node's argmax depends only on the tokens above it). For a
   sampled trace it is the recorded accepted path cut where it leaves the subtree: an
   approximation, flagged in the results;
3. the verify pass costs `cost.predict_ms(|S|, U)` with U[l] the distinct experts layer l loads for
   the chosen nodes S according to their *recorded* routing; offloaded (`resident`), plus the cost
   model's fetch time for the experts of U missing from a cache of that many per layer, replayed
   along the policy's own passes (`replay_cache`: each policy pays the misses its own choices leave,
   and `moe-aware` prices the residency of that cache as it prices the live one);
4. the draft time is added: by default (`scaled`) the recorded one (EAGLE-2 drafting its full
   candidate tree) times the ratio of the simulated to the profiled cost of the target's non-expert
   work, (base_ms + per_token_ms) / (base_ms' + per_token_ms'), since a draft head is a small dense
   model that speeds up or slows down with the device, not with expert loading. Under the profile's
   own model and its per-expert scalings that ratio is 1: the recorded time. `recorded` keeps it
   always, `zero` drops it (free drafting, an upper bound). Policies see the same draft time when
   they choose.

`ar` produces one token per step at `cost.predict_ms(1, U_root)`, U_root the root's own experts.
Figures cover decode steps only (no prefill), totals over steps, as in `bench/report.py`.

Not modelled: each policy replays EAGLE-2's trajectory (the prefix a step starts from is the one
EAGLE-2 reached, not the one the policy would have); every policy pays EAGLE-2's draft time, though
`static:N` and `moe-aware` draft smaller trees in a real run; `moe-aware` chooses from the full
60-node tree, while in a real run it sizes its candidate tree from recent steps; no policy pays
controller time (plan_ms). Offloaded, the prefill's reads (not traced) are not replayed: each prompt's
first steps start from a cold cache; the bound's replay takes each arm's step as that arm's own
passes priced it, not as the mix the bandit chose would have left the cache; and the selection
ceiling is chosen step by step given the cache (`cached_selection`), a heuristic rather than a bound.

For a greedy trace with `moe-aware` asked, `moe-aware, bounded (replay)` is `moe-aware` as a live run
decides: its bandit choosing, step by step, among the replays of its arms (`bound_replay.py`).

Beside the policies, every replay reports the bounds and oracles of `experiments/bounds.py` (the
selection ceiling, each with its draft accounting; `moe-aware` with true routing, with realised
acceptance, with the draft sized to what it verified; `static-best` with a sized draft) and, from
them, `bounds.decomposition`. `measured_cost_error` compares the profile's cost model with the
verify times the trace measured, the one part of the decomposition a replay cannot give (a replay
under the profile's model prices by that model).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from moe_spec.core.acceptance import accept_greedy
from moe_spec.policy.bounded_controller import PLAIN, SIZED
from moe_spec.policy.moe_aware import MoeAwareController
from moe_spec.policy.profiled import ProfiledController
from moe_spec.policy.registry import AR, STATIC_BEST, build_controller, expand_methods, parse_methods, static_grid_names
from moe_spec.core.control import Controller
from moe_spec.core.drafting import EAGLE2_BUDGET
from moe_spec.profile.cost_model import CostModel, expected_unique_experts
from moe_spec.errors import InputError
from moe_spec.profile.artifact import Profile
from moe_spec.core.forest import StepForest
from moe_spec.core.step_record import StepRecord
from moe_spec.experiments.bounds import (
    ALL_ORACLES, CEILING, REALISED, SIZED_CEILING, SIZED_DRAFT, STATIC_SIZED, TRUE_ROUTING, OracleMoeAware,
    path_prefix_options, profiled_draft_cost, selection_ceiling, sized_draft_ms,
)
from moe_spec.experiments.bound_replay import BOUNDED, BoundSettings, replay_bound
from moe_spec.experiments.replay_cache import Pricing, PricedPasses
from moe_spec.offload.resident_cache import Eviction
from moe_spec.experiments.trace_file import Trace, TraceError
from moe_spec.core.tree import DraftTree

DRAFT_TIMES = ("scaled", "recorded", "zero")
DEFAULT_POLICIES = (AR, "eagle2", STATIC_BEST, "truncate", "moe-aware", "moe-aware-noexperts")
BOUNDS = (BOUNDED, CEILING, SIZED_CEILING, STATIC_SIZED, SIZED_DRAFT, TRUE_ROUTING, REALISED, ALL_ORACLES)  # report order


def parse_policies(spec: str) -> list[str]:
    """`--methods`: names of `moe_spec.policy.registry`, checked there."""
    return parse_methods(spec, option="--methods")


@dataclass(frozen=True)
class ReplayedStep:
    keep: tuple[int, ...]  # verified nodes, as indices into the traced tree (root first)
    tokens: int  # produced: accepted drafts + the bonus token
    verify_ms: float  # simulated
    draft_ms: float  # recorded
    unique_experts: tuple[int, ...]  # [L] distinct experts per MoE layer over `keep`, from recorded routing
    misses: int | None = None  # experts fetched over all layers (an offloaded replay; else None)


def unique_experts(step: StepRecord, keep: Sequence[int]) -> tuple[int, ...]:
    """[L] distinct experts each MoE layer loads for nodes `keep`, from the recorded routing."""
    chosen = step.experts()[:, list(keep)]  # [L, |S|, K]
    return tuple(int(torch.unique(layer).numel()) for layer in chosen)


def subtree_indices(tree: DraftTree, chosen: DraftTree) -> list[int]:
    """The node indices of `tree` making up `chosen`, a `tree.subtree(...)` returned by a controller.

    `subtree` keeps node order, so chosen node j is the first child of its (mapped) parent after
    chosen node j - 1 with the same token and score.
    """
    children: list[list[int]] = [[] for _ in range(len(tree))]
    for node, parent in enumerate(tree.parents.tolist()[1:], start=1):
        children[parent].append(node)
    tokens, scores = tree.tokens.tolist(), tree.scores.tolist()
    index = [0]
    for j, (token, score, parent) in enumerate(zip(chosen.tokens.tolist(), chosen.scores.tolist(), chosen.parents.tolist())):
        if j == 0:
            continue
        match = next((c for c in children[index[parent]] if c > index[-1] and tokens[c] == token and scores[c] == score), None)
        if match is None:
            raise TraceError("a policy returned a tree that is not a subtree of the traced candidates")
        index.append(match)
    return index


def accepted_tokens(step: StepRecord, keep: Sequence[int], greedy: bool) -> int:
    """Tokens the step produces when only `keep` is verified (see module docstring, point 2)."""
    if greedy:
        keep = list(keep)
        tree, argmax = step.tree(), step.node_argmax()
        vocabulary = int(max(argmax.max(), tree.tokens.max())) + 1
        logits = torch.nn.functional.one_hot(argmax[keep], vocabulary).float()  # [|S|, V]
        return accept_greedy(tree.subtree(keep), logits).num_accepted + 1
    kept = set(keep)
    produced = 1
    for node in step.acceptances[0].path[1:]:
        if node not in kept:
            break
        produced += 1
    return produced


def replay_step(step: StepRecord, controller: Controller, passes: PricedPasses, greedy: bool,
                draft_factor: float = 1.0) -> ReplayedStep:
    draft_ms = step.draft_ms * draft_factor
    tree = step.tree()
    chosen = controller.plan(StepForest((tree,)), draft_ms).verify[0]
    keep = tuple(subtree_indices(tree, chosen)) if tree.num_drafted else (0,)
    return priced_step(step, keep, accepted_tokens(step, keep, greedy), draft_ms, passes)


def priced_step(step: StepRecord, keep: tuple[int, ...], tokens: int, draft_ms: float, passes: PricedPasses) -> ReplayedStep:
    """The pass of nodes `keep` on `step`, priced by `passes` (its misses admitted to its cache)."""
    ms, misses, unique = passes.verify(step, keep)
    return ReplayedStep(keep, tokens, ms, draft_ms, unique, misses)


def draft_factor(draft_time: str, cost: CostModel, profiled: CostModel) -> float:
    """What the recorded draft times are multiplied by (see module docstring, point 4)."""
    if draft_time not in DRAFT_TIMES:
        raise InputError(f"draft time must be one of {', '.join(DRAFT_TIMES)}, got {draft_time!r}")
    if draft_time == "zero":
        return 0.0
    dense, dense_profiled = cost.base_ms + cost.per_token_ms, profiled.base_ms + profiled.per_token_ms
    if draft_time == "recorded" or dense == dense_profiled:
        return 1.0
    if dense_profiled <= 0:
        raise InputError("the profile's cost model has no non-expert cost to scale draft times by; use draft time 'recorded'")
    return dense / dense_profiled


def ar_replay(trace: Trace, pricing: Pricing) -> list[ReplayedStep]:
    """`ar` on every traced step: the root alone, one token."""
    passes, steps = pricing.passes(trace.num_experts), []
    for step, first in trace.prompt_steps():
        if first:
            passes.begin()
        steps.append(priced_step(step, (0,), 1, 0.0, passes))
    return steps


def recorded_step(step: StepRecord) -> ReplayedStep:
    """The step as it was measured (EAGLE-2 verifying its whole tree), for comparison."""
    keep = tuple(range(len(step.tree())))
    return ReplayedStep(keep, len(step.acceptances[0].path), step.verify_ms, step.draft_ms, unique_experts(step, keep))


def check_greedy_trace(trace: Trace) -> None:
    """Scoring each traced tree from its recorded argmax must give the recorded accepted path."""
    for number, step in enumerate(trace.steps):
        tree, argmax, recorded = step.tree(), step.node_argmax(), step.acceptances[0].path
        vocabulary = int(max(argmax.max(), tree.tokens.max())) + 1
        acceptance = accept_greedy(tree, torch.nn.functional.one_hot(argmax, vocabulary).float())
        if acceptance.path != list(recorded):
            raise TraceError(f"{trace.path}: prompt {step.rows[0]} (step {number} of the trace): the recorded argmax "
                             f"does not reproduce the recorded accepted path {list(recorded)}")


def summarise(steps: Sequence[ReplayedStep]) -> dict:
    """A policy's figures over replayed steps (`speedup_vs_ar` is filled in by `simulate`)."""
    n = len(steps)
    tokens = sum(s.tokens for s in steps)
    verify = sum(s.verify_ms for s in steps)
    draft = sum(s.draft_ms for s in steps)
    loads = sum(sum(s.unique_experts) for s in steps)
    misses = [s.misses for s in steps if s.misses is not None]
    per_layer = [sum(s.unique_experts) / len(s.unique_experts) for s in steps if s.unique_experts]
    return {
        "tokens_per_s": _round(1000.0 * tokens / (verify + draft) if verify + draft > 0 else 0.0),
        "speedup_vs_ar": None,
        "mean_accept_len": _round(tokens / n if n else 0.0),
        "verify_ms": _round(verify / n if n else 0.0),
        "draft_ms": _round(draft / n if n else 0.0),
        "unique_experts_per_layer": _round(sum(per_layer) / len(per_layer) if per_layer else 0.0),
        "expert_loads_per_token": _round(loads / tokens if tokens else 0.0),
        "mean_tree_size": _round(sum(len(s.keep) - 1 for s in steps) / n if n else 0.0),
        "misses_per_token": _round(sum(misses) / tokens) if misses and tokens else None,
        "tokens": tokens,
        "steps": n,
    }


@dataclass(frozen=True)
class PolicyReplay:
    name: str
    steps: list[ReplayedStep]
    figures: dict


def simulate(trace: Trace, profile: Profile, cost: CostModel, policies: Sequence[str],
             draft_time: str = "scaled", resident: int | None = None,
             eviction: Eviction = Eviction.LRU) -> dict[str, PolicyReplay]:
    """Policy name -> its replay of every traced step under `cost`, then the bounds (`BOUNDS`, those
    whose policy was asked for; see module docstring). With `resident` experts per layer, experts
    are offloaded behind a cache of that size (`replay_cache`)."""
    if resident is not None and cost.fetch is not None:  # the overflow beyond the slots, at the replayed cache's size
        cost = replace(cost, fetch=cost.fetch.at_capacity(resident))
    simulated = replace(profile, cost_model=cost)
    pricing = Pricing(cost, resident, eviction)
    factor = draft_factor(draft_time, cost, profile.cost_model)
    ar = ar_replay(trace, pricing)
    results: dict[str, PolicyReplay] = {AR: PolicyReplay(AR, ar, summarise(ar))}
    for name in [n for n in expand_methods(list(policies)) if n != AR]:
        results[name] = replay_policy(name, trace, lambda residency, name=name: build_controller(
            name, lambda: simulated, adapt=False, residency=residency), pricing, factor)
    if STATIC_BEST in policies:
        grid = [results[n] for n in static_grid_names()]
        best = max(grid, key=lambda r: r.figures["tokens_per_s"])
        results[STATIC_BEST] = PolicyReplay(STATIC_BEST, best.steps, {**best.figures, "budget": best.name})
    results.update(bound_replays(trace, simulated, results, factor, pricing))
    if "moe-aware" in results and trace.greedy:
        results[BOUNDED] = bounded_replay(trace, simulated, results, factor, pricing)
    baseline = results[AR].figures["tokens_per_s"]
    for result in results.values():
        result.figures["speedup_vs_ar"] = _round(result.figures["tokens_per_s"] / baseline) if baseline > 0 else None
    # `ar` is always replayed (the unit of speedup), the selection ceilings always shown
    return {name: results[name] for name in [*policies, *[b for b in BOUNDS if b in results]]}


def replay_policy(name: str, trace: Trace, controller: Callable[..., Controller], pricing: Pricing,
                  factor: float) -> PolicyReplay:
    """`controller(residency)` (built on the replay's own cache: None where every expert is resident)
    planning every traced step (an `OracleMoeAware` is shown each step first). For a profile-driven
    controller, `predicted_accept_len` is what its values expected of its choices."""
    passes = pricing.passes(trace.num_experts)
    controller = controller(passes.residency)
    replayed, predicted = [], []
    for step, first in trace.prompt_steps():
        if first:  # a new prompt: a new `generate` call, from a cold cache
            controller.begin(EAGLE2_BUDGET)
            passes.begin()
        if isinstance(controller, OracleMoeAware):
            controller.reveal(step)
        replayed.append(replay_step(step, controller, passes, trace.greedy, factor))
        if isinstance(controller, ProfiledController):
            drafted = list(replayed[-1].keep[1:])
            predicted.append(1.0 + (float(controller.values(step.tree())[drafted].sum()) if drafted else 0.0))
    figures = summarise(replayed)
    if predicted:
        figures["predicted_accept_len"] = _round(sum(predicted) / len(predicted))
    return PolicyReplay(name, replayed, figures)


def bound_arms(trace: Trace, simulated: Profile, factor: float, fixed_nodes: Sequence[int],
               results: dict[str, PolicyReplay] | None = None,
               pricing: Pricing | None = None) -> tuple[list, dict[int, list], list]:
    """The replayed steps of the bound's arms: its sizing (gate off: the bandit's plain arm gates),
    each fixed budget (nodes -> `static:nodes`'s, reused from `results` where there) and plain
    decoding (`ar`'s), each priced by `pricing` (default: the simulated profile's cost model, every
    expert resident) along its own passes."""
    results = results or {}
    pricing = pricing or Pricing(simulated.cost_model)
    sized = replay_policy("sized", trace, lambda residency: MoeAwareController(
        simulated, adapt=False, gate=False, residency=residency), pricing, factor).steps
    fixed = {}
    for nodes in fixed_nodes:
        name = f"static:{nodes}"
        replay = results.get(name) or replay_policy(name, trace, lambda residency, name=name: build_controller(
            name, lambda: simulated, adapt=False, residency=residency), pricing, factor)
        fixed[nodes] = replay.steps
    plain = results[AR].steps if AR in results else ar_replay(trace, pricing)
    return sized, fixed, plain


def bounded_replay(trace: Trace, simulated: Profile, results: dict[str, PolicyReplay], factor: float,
                   pricing: Pricing, settings: BoundSettings = BoundSettings()) -> PolicyReplay:
    """`moe-aware` as a live run decides (`experiments/bound_replay.py`): the bandit over its arms'
    replays (`bound_arms`); greedy traces only (a sampled one tells no smaller budget's tokens).
    Offloaded, each arm's steps are priced along its own passes, not along the mix the bandit plays."""
    sized, fixed, plain = bound_arms(trace, simulated, factor, settings.fixed, results, pricing)
    if not settings.priors:
        settings = replace(settings, priors=_greedy_priors(simulated, pricing.offloaded))
    chosen, decisions = replay_bound([step.rows[0] for step in trace.steps], sized, fixed, plain, settings)
    shares = {arm: _round(count / len(chosen)) for arm, count in decisions.most_common()} if chosen else {}
    arms = {SIZED: summarise(sized), **{f"static:{n}": summarise(steps) for n, steps in fixed.items()},
            PLAIN: summarise(plain)}
    best = max(arms, key=lambda arm: arms[arm]["tokens_per_s"])
    note = "replay: the live bandit choosing among its arms' replays, step by step" + (
        f"; step times jittered by {settings.noise:.0%}" if settings.noise else "")
    return PolicyReplay(BOUNDED, chosen, {**summarise(chosen), "decisions": shares, "best_arm": best,
                                          "arm_tokens_per_s": {arm: f["tokens_per_s"] for arm, f in arms.items()},
                                          "bound": note})


def _greedy_priors(simulated: Profile, offloaded: bool) -> tuple[tuple[str, float], ...]:
    """The arms' rates the profile measured greedily on one row, as a live run's bandit takes them
    (offloaded ones where the replay prices fetches)."""
    for entry in simulated.arm_rates:
        if entry.sampling.greedy and entry.rows == 1 and (entry.resident_experts is not None) == offloaded:
            return tuple(sorted(entry.rates.items()))
    return ()


def bound_replays(trace: Trace, simulated: Profile, results: dict[str, PolicyReplay], factor: float,
                  pricing: Pricing) -> dict[str, PolicyReplay]:
    """The replays of `experiments/bounds.py` beside `results`: the ceilings always, the moe-aware
    oracles with `moe-aware`, the sized static-best with `static-best`."""
    draft_cost = profiled_draft_cost(simulated)

    def recorded(step: StepRecord, keep: Sequence[int]) -> float:
        return step.draft_ms * factor

    def sized(step: StepRecord, keep: Sequence[int]) -> float:
        return sized_draft_ms(step, keep, step.draft_ms * factor, draft_cost)

    sizing = ("draft time of the verified subtree's size: the replayed draft time x the profile's draft-cost formula "
              "at that depth and node count / at the candidates'" if draft_cost is not None else
              "draft time of the verified subtree's depth: the replayed draft time x its depth / the candidates'")
    bounds = {
        CEILING: ceiling_replay(CEILING, trace, pricing, recorded, "replay: verifies exactly the accepted path's best prefix"),
        SIZED_CEILING: ceiling_replay(SIZED_CEILING, trace, pricing, sized,
                                      f"replay: verifies exactly the accepted path's best prefix; {sizing}"),
    }
    if STATIC_BEST in results:
        grid = [resized(results[n], STATIC_SIZED, trace, sized, sizing) for n in static_grid_names()]
        best = max(grid, key=lambda r: r.figures["tokens_per_s"])
        budget = static_grid_names()[grid.index(best)]
        bounds[STATIC_SIZED] = PolicyReplay(STATIC_SIZED, best.steps, {**best.figures, "budget": budget})
    if "moe-aware" in results:
        bounds[SIZED_DRAFT] = resized(results["moe-aware"], SIZED_DRAFT, trace, sized,
                                      f"replay: moe-aware's choices, {sizing}; no controller time (as every replay)")
        oracles = {TRUE_ROUTING: (True, False, "replay: priced by the recorded routing of every node"),
                   REALISED: (False, True, "replay: node values 1 on the recorded accepted path, 0 elsewhere"),
                   ALL_ORACLES: (True, True, f"replay: recorded routing, realised acceptance and {sizing}")}
        for name, (routing, acceptance, note) in oracles.items():
            replay = replay_policy(name, trace, lambda residency, routing=routing, acceptance=acceptance: OracleMoeAware(
                simulated, routing, acceptance, residency=residency), pricing, factor)
            if name == ALL_ORACLES:
                replay = resized(replay, name, trace, sized, note)
            bounds[name] = PolicyReplay(name, replay.steps, {**replay.figures, "bound": note})
    return bounds


def resized(replay: PolicyReplay, name: str, trace: Trace, draft_ms, note: str) -> PolicyReplay:
    """`replay`'s choices, each step charged `draft_ms(step, keep)` for drafting instead."""
    steps = [replace(s, draft_ms=draft_ms(step, s.keep)) for step, s in zip(trace.steps, replay.steps)]
    extra = {k: v for k, v in replay.figures.items() if k == "predicted_accept_len"}
    return PolicyReplay(name, steps, {**summarise(steps), **extra, "bound": note})


def ceiling_replay(name: str, trace: Trace, pricing: Pricing, draft_ms, note: str) -> PolicyReplay:
    """The selection ceiling: the best throughput any node selection could reach on these steps,
    each choice charged `draft_ms(step, keep)` for drafting (offloaded: a heuristic, see
    `cached_selection`)."""
    if pricing.offloaded:
        picks = cached_selection(trace, pricing, draft_ms)
        note += "; offloaded: chosen step by step given the cache the earlier choices left (a heuristic, not a bound)"
    else:
        passes = pricing.passes(trace.num_experts)
        options = [path_prefix_options(step, lambda keep, step=step: draft_ms(step, keep) + passes.peek_ms(step, keep))
                   for step in trace.steps]
        picks = [opts[i][2] for opts, i in zip(options, selection_ceiling(options))]
    passes, steps = pricing.passes(trace.num_experts), []
    for (step, first), keep in zip(trace.prompt_steps(), picks):
        if first:
            passes.begin()
        steps.append(priced_step(step, keep, len(keep), draft_ms(step, keep), passes))
    return PolicyReplay(name, steps, {**summarise(steps), "bound": note})


def cached_selection(trace: Trace, pricing: Pricing, draft_ms) -> list[tuple[int, ...]]:
    """The nodes verified on each step by Dinkelbach's iteration where a pass's price depends on the
    passes before it (misses of an offload cache): at each rate, each step in turn takes the prefix of
    its accepted path of most tokens - rate x ms, priced on the cache its earlier steps left; the
    rate is then that choice's, until it stops rising. Without a cache this is the exact ceiling of
    `selection_ceiling`; with one, each step is greedy given the past, so it is a heuristic."""
    def choose(rate: float | None) -> tuple[list[tuple[int, ...]], float]:
        passes, picks, tokens, ms = pricing.passes(trace.num_experts), [], 0, 0.0
        for step, first in trace.prompt_steps():
            if first:
                passes.begin()
            options = path_prefix_options(step, lambda keep, step=step: draft_ms(step, keep) + passes.peek_ms(step, keep))
            if rate is None:  # the whole accepted path, to start from
                keep = options[-1][2]
            else:
                keep = max(options, key=lambda o: (o[0] - rate * o[1], -o[0]))[2]
            picks.append(keep)
            tokens += len(keep)
            ms += draft_ms(step, keep) + passes.verify(step, keep)[0]
        return picks, tokens / ms if ms > 0 else float("inf")

    picks, current = choose(None)
    while True:
        better, new = choose(current)
        if new <= current * (1 + 1e-12):
            return picks
        picks, current = better, new


def measured_cost_error(trace: Trace, profile: Profile) -> dict:
    """The profile's cost model against the verify times the trace measured (EAGLE-2's whole trees;
    `profile` should be the one the bench priced with, the trace's own):
    priced on the recorded routing (the formula's own error) and on the profile's predicted routing
    (what the controller sees: formula and routing prediction together)."""
    cost, measured, on_recorded, on_predicted = profile.cost_model, [], [], []
    for step in trace.steps:
        tree = step.tree()
        measured.append(step.verify_ms)
        on_recorded.append(cost.predict_ms(len(tree), unique_experts(step, range(len(tree)))))
        if cost.num_layers:
            on_predicted.append(cost.predict_ms(len(tree), expected_unique_experts(profile.priced_experts(tree.tokens))))

    def summary(predicted: list[float]) -> dict:
        errors = sorted(abs(p - m) / m for p, m in zip(predicted, measured) if m > 0)
        return {"predicted_ms": _round(sum(predicted) / len(predicted)),
                "predicted_over_measured": _round(sum(predicted) / sum(measured)) if sum(measured) > 0 else None,
                "median_abs_error": _round(errors[len(errors) // 2]) if errors else None}

    return {"measured_ms": _round(sum(measured) / len(measured)), "steps": len(measured),
            "recorded_routing": summary(on_recorded),
            "predicted_routing": summary(on_predicted) if on_predicted else None,
            "note": "measured on the tracing machine (verify of the whole traced tree), not simulated"}


def _round(value: float) -> float:
    return round(value, 4)
