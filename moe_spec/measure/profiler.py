"""Profiling a target: decode real prompts, time verify passes, fit, and assemble a `Profile`.

Prompts are split by index: every `heldout_every`-th prompt is held out. Fitted on the others:
the token-id expert table and the cost model; evaluated on the held-out prompts' draft trees:
the table's recall / precision and the cost model's error on natural trees. The acceptance
calibration is fitted on every step and its reliability is cross-fitted (see `calibration.py`).

`build_profile` runs the stages in order: 1) decode, 2) routing statistics and expert table,
3) calibration, 4) latency sweep, 5) cost fit and its report, 6) assemble.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import partial

import numpy as np
import torch

from moe_spec.core.drafting import Drafter, TreeBudget
from moe_spec.core.forest import StepForest
from moe_spec.core.step_record import StepRecord
from moe_spec.core.target import TargetModel
from moe_spec.core.tree import DraftTree
from moe_spec.measure.decoding import PromptTrace, decode_prompts
from moe_spec.measure.latency import (
    CacheEvictor,
    TimingConfig,
    batched_prefill_cache,
    batched_verify_run,
    draft_cost,
    grid_configs,
    grid_runs,
    prefill_cache,
    time_round_robin,
    verify_run,
)
from moe_spec.measure.loop_passes import loop_passes
from moe_spec.measure.routing_stats import RoutingStats, best_first_order, unique_experts_curve
from moe_spec.measure.sweep import LatencySweep, TimedPass
from moe_spec.profile.artifact import ExpertPricing, Profile, fingerprint, hardware_description
from moe_spec.profile.calibration import AcceptanceCalibration, NodeSamples, cross_fitted_report
from moe_spec.profile.cost_model import CostModel, CostSample, r_squared, relative_errors
from moe_spec.profile.loop_alignment import fit_loop_map
from moe_spec.profile.expert_table import TokenExpertTable, evaluate_predictor
from moe_spec.profile.unique_curve import UniqueExpertsCurve

Progress = Callable[[str, int], Callable[[], None]]  # (stage description, total) -> tick


def _no_progress(description: str, total: int) -> Callable[[], None]:
    return lambda: None


@dataclass(frozen=True)
class ProfileSettings:
    max_new_tokens: int = 48  # per prompt
    candidate_budget: TreeBudget | None = None  # None: the drafter's default budget, full trees verified
    heldout_every: int = 4  # prompts 3, 7, 11, ... are held out
    prefix_len: int = 128  # cached context under the latency grid
    grid_tokens: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    grid_experts: tuple[int, ...] = (2, 4, 8, 16, 32, 48, 64)  # infeasible (T, U) pairs are skipped
    natural_trees: int = 40  # timed natural trees, fit and held-out together
    curve_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 60)
    # batched verify passes timed from natural trees (B rows each); two or more sizes besides the
    # one-row passes pin down the cost model's per-row term
    batch_sizes: tuple[int, ...] = (2, 4, 8, 16)
    batched_passes: int = 8  # per batch size, half of them held out
    timing: TimingConfig = field(default_factory=TimingConfig)
    per_layer_cost: bool = False  # one expert cost per layer instead of one shared
    # the sweep's model mapped onto passes timed in the decode loop (`moe_spec.profile.loop_alignment`)
    loop_alignment: bool = True
    seed: int = 0

    def __post_init__(self):
        if (self.max_new_tokens < 2 or self.heldout_every < 2 or self.prefix_len < 1 or self.natural_trees < 0
                or any(rows < 1 for rows in self.batch_sizes) or self.batched_passes < 0):
            raise ValueError(f"invalid profile settings {self}")


@dataclass(frozen=True)
class Decoded:
    """Stage 1: the prompts' traces and which prompts are held out."""

    traces: tuple[PromptTrace, ...]
    held_out: frozenset[int]  # prompt indices
    seconds: float

    @property
    def fit_traces(self) -> list[PromptTrace]:
        return [t for t in self.traces if t.prompt_index not in self.held_out]

    @property
    def steps(self) -> list[StepRecord]:
        return [s for t in self.traces for s in t.steps]

    @property
    def groups(self) -> list[int]:
        """The prompt of each of `steps`, the calibration's cross-fitting unit."""
        return [t.prompt_index for t in self.traces for _ in t.steps]

    def split(self) -> tuple[list[tuple[PromptTrace, StepRecord]], list[tuple[PromptTrace, StepRecord]]]:
        """(fit, held-out) steps with their traces; with one prompt, every other step is held out."""
        pairs = [(t, s) for t in self.traces for s in t.steps]
        heldout = [(t, s) for t, s in pairs if t.prompt_index in self.held_out]
        if not heldout:
            return pairs[0::2], pairs[1::2]
        return [(t, s) for t, s in pairs if t.prompt_index not in self.held_out], heldout


@dataclass(frozen=True)
class RoutingResult:
    """Stage 2: routing statistics and the expert table fitted on them."""

    table: TokenExpertTable
    pricing: ExpertPricing
    curve: UniqueExpertsCurve
    summary: dict  # details["routing"]
    predictor_report: dict  # details["expert_predictor"]
    arrays: dict[str, np.ndarray]  # routing_load [L, E], routing_coactivation [L, E, E]


@dataclass(frozen=True)
class CalibrationResult:
    """Stage 3."""

    calibration: AcceptanceCalibration | None  # None: the drafter proposed nothing
    report: dict | None  # details["calibration"]


@dataclass(frozen=True)
class NaturalTree:
    """A recorded tree to time on its own context."""

    tree: DraftTree
    context: torch.Tensor  # [P] long
    split: str  # "fit" or "heldout"


@dataclass(frozen=True)
class SweepResult:
    """Stage 4: every timed pass; the held-out natural trees beside their timings (for pricing
    their predicted experts)."""

    sweep: LatencySweep
    heldout_natural: list[tuple[DraftTree, TimedPass]]


@dataclass(frozen=True)
class CostFit:
    """Stage 5."""

    model: CostModel
    report: dict  # details["cost_model_report"]


def build_profile(
    target: TargetModel,
    drafter: Drafter | None,
    prompts: Sequence[torch.Tensor],  # each [T] long
    settings: ProfileSettings,
    progress: Progress = _no_progress,
    drafter_description: str = "none",
) -> Profile:
    start = time.perf_counter()
    generator = torch.Generator().manual_seed(settings.seed)
    if not prompts:
        raise ValueError("no prompts to profile on")
    decoded = _decode(target, drafter, prompts, settings, progress)
    routing = _routing(target, decoded, settings, generator) if target.is_moe else None
    calibration = _calibrate(decoded)
    swept = _sweep(target, decoded, settings, generator, progress)
    cost = _fit_cost(swept, routing.table if routing else None, settings)
    if settings.loop_alignment and drafter is not None and decoded.steps:
        cost = _aligned_to_loop(cost, target, drafter, prompts, decoded, settings, progress)
    details: dict = {"decoding": _decoding_summary(decoded.traces)}
    if routing is not None:
        details["routing"], details["expert_predictor"] = routing.summary, routing.predictor_report
    if calibration.report is not None:
        details["calibration"] = calibration.report
    details["latency"] = swept.sweep.to_dict()
    details["cost_model_report"] = cost.report
    if drafter is not None and decoded.steps:
        details["draft_cost"] = _draft_cost(drafter, decoded.traces[-1], settings).to_dict()
    details["measurement"] = _measurement(target, decoded, settings, drafter_description, time.perf_counter() - start)
    return Profile(
        fingerprint=fingerprint(target),
        hardware=hardware_description(target.device),
        cost_model=cost.model,
        calibration=calibration.calibration,
        expert_table=routing.table if routing else None,
        expert_pricing=routing.pricing if routing else None,
        unique_experts_curve=routing.curve if routing else None,
        details=details,
        arrays=routing.arrays if routing else {},
    )


# 1) decode
def _decode(target, drafter, prompts, settings: ProfileSettings, progress: Progress) -> Decoded:
    start = time.perf_counter()
    tick = progress("decoding prompts", len(prompts))
    traces = decode_prompts(target, drafter, prompts, settings.max_new_tokens, settings.candidate_budget, tick)
    every = settings.heldout_every
    held_out = {i for i in range(len(prompts)) if i % every == every - 1}
    if not held_out and len(prompts) > 1:
        held_out = {len(prompts) - 1}
    return Decoded(tuple(traces), frozenset(held_out), time.perf_counter() - start)


def _decoding_summary(traces: Sequence[PromptTrace]) -> dict:
    steps = [s for t in traces for s in t.steps]
    if not steps:
        return {"steps": 0}
    accepted = [len(s.acceptances[0].path) for s in steps]  # includes the bonus token
    return {
        "steps": len(steps),
        "new_tokens": sum(accepted) + len(traces),
        "mean_candidate_nodes": float(np.mean([s.candidates[0].num_drafted for s in steps])),
        "mean_accept_len": float(np.mean(accepted)),
        "mean_verify_ms": float(np.mean([s.verify_ms for s in steps])),
        "mean_draft_ms": float(np.mean([s.draft_ms for s in steps])),
    }


# 2) routing statistics and expert table
def _routing(target: TargetModel, decoded: Decoded, settings: ProfileSettings, generator: torch.Generator) -> RoutingResult:
    stats = RoutingStats(target.vocab_size, len(target.routers), target.num_experts, target.top_k)
    for trace in decoded.fit_traces or decoded.traces:
        stats.add(trace.tokens, trace.experts)
    pool = torch.cat([t.experts for t in decoded.traces], dim=1)  # [L, P, K]
    curve = unique_experts_curve(decoded.steps, pool, settings.curve_sizes, generator)
    table = stats.expert_table()
    report = evaluate_predictor(table, [s for _, s in decoded.split()[1]])
    soft = np.mean(report.unique_relative_error or [np.inf])
    hard = np.mean(report.unique_relative_error_topk or [np.inf])
    summary = {
        "tokens": stats.num_tokens,
        "distinct_token_ids": int((stats.token_totals > 0).sum()),
        "imbalance_max_over_mean": stats.imbalance().tolist(),
        "idle_experts": stats.idle_experts().tolist(),
        "token_id_concentration": stats.token_concentration().tolist(),
    }
    return RoutingResult(
        table=table,
        pricing=ExpertPricing.TOPK if hard < soft else ExpertPricing.PROBABILITIES,
        curve=curve,
        summary=summary,
        predictor_report=report.to_dict(),
        arrays={"routing_load": stats.load, "routing_coactivation": stats.coactivation},
    )


# 3) calibration
def _calibrate(decoded: Decoded) -> CalibrationResult:
    samples = NodeSamples.from_steps(decoded.steps, decoded.groups)
    if not len(samples):
        return CalibrationResult(None, None)
    report = cross_fitted_report(decoded.steps, decoded.groups).to_dict()
    return CalibrationResult(AcceptanceCalibration.fit(samples), report)


# 4) latency sweep
def _sweep(target: TargetModel, decoded: Decoded, settings: ProfileSettings, generator: torch.Generator,
           progress: Progress) -> SweepResult:
    """Grid, natural trees and batched passes timed in one interleaved sweep, so all see the same machine load."""
    start = time.perf_counter()
    longest = max(decoded.traces, key=lambda t: t.tokens.numel()).tokens
    prefix = longest.repeat(settings.prefix_len // longest.numel() + 1)[: settings.prefix_len]
    num_layers = len(target.routers)
    configs = grid_configs(target, settings.grid_tokens, settings.grid_experts)
    runs = grid_runs(target, prefill_cache(target, prefix), configs, generator)  # draws from `generator` first
    fit, heldout = decoded.split()
    natural = _natural_trees(fit, heldout, settings.natural_trees, generator)
    batched = _batched_passes([s for _, s in fit + heldout], settings, generator)
    # each run beside what its timing becomes
    plans = [(partial(TimedPass.of, "grid", "fit", tokens, unique=(unique,) * num_layers), run)
             for (tokens, unique), run in zip(configs, runs)]
    plans += [(partial(TimedPass.of, "natural", n.split, len(n.tree)), verify_run(target, prefill_cache(target, n.context), n.tree))
              for n in natural]
    caches = {rows: batched_prefill_cache(target, prefix, rows) for rows in {forest.rows for forest, _ in batched}}
    plans += [(partial(TimedPass.of, "batched", split, forest.pass_tokens, rows=forest.rows, width=forest.width),
               batched_verify_run(target, caches[forest.rows], list(forest)))
              for forest, split in batched]
    tick = progress(f"timing {len(plans)} verify passes (repeats)", settings.timing.repeats)
    evictor = CacheEvictor(settings.timing.evict_mb, target.device)
    timings = time_round_robin([run for _, run in plans], settings.timing, evictor, tick)
    passes = tuple(make(timing) for (make, _), timing in zip(plans, timings))
    for timed, timing in zip(passes, timings):
        if timed.kind == "grid" and target.is_moe and set(timing.unique_experts) != set(timed.unique_experts):
            raise RuntimeError(f"forcing {timed.unique_experts[0]} experts per layer gave {timing.unique_experts}")
    sweep = LatencySweep(settings.timing.statistic, settings.prefix_len, time.perf_counter() - start, passes)
    heldout_natural = [(n.tree, timed) for n, timed in zip(natural, sweep.of_kind("natural")) if n.split == "heldout"]
    return SweepResult(sweep, heldout_natural)


def _natural_trees(fit, heldout, count: int, generator: torch.Generator) -> list[NaturalTree]:
    """Recorded verified trees (from (trace, step) pairs) to time on their own context, half from
    held-out prompts. Every other one is cut to a best-first prefix of a size drawn log-uniformly
    from 1 to its own: the recorded trees are the drafter's whole candidate budget, while a
    controller verifies from one node to that, most often a few."""
    half = count // 2
    chosen = [(pair, "fit") for pair in _spread(fit, count - half)] + [(pair, "heldout") for pair in _spread(heldout, half)]
    trees = []
    for index, ((trace, step), split) in enumerate(chosen):
        tree = step.tree()
        if index % 2:
            # exp(u log n) with u in [0, 1) lies in [1, n), so the rounded size is in 1..n
            size = int(math.exp(float(torch.rand((), generator=generator)) * math.log(len(tree))) + 0.5)
            tree = tree.subtree(best_first_order(tree)[:size])
        trees.append(NaturalTree(tree, trace.context(step), split))
    return trees


def _spread(pairs: Sequence[tuple[PromptTrace, StepRecord]], count: int) -> list[tuple[PromptTrace, StepRecord]]:
    """Up to `count` steps spread evenly over tree sizes (the largest trees matter most)."""
    if count <= 0 or not pairs:
        return []
    ordered = sorted(pairs, key=lambda pair: len(pair[1].tree()))
    if len(ordered) <= count:
        return ordered
    picks = np.unique(np.linspace(0, len(ordered) - 1, count).round().astype(int))
    return [ordered[i] for i in picks]


def _batched_passes(steps: Sequence[StepRecord], settings: ProfileSettings,
                    generator: torch.Generator) -> list[tuple[StepForest, str]]:
    """For each batch size B, `batched_passes` groups of B recorded trees (drawn at random, each cut to a
    random best-first prefix, as a controller would cut it), half held out."""
    groups = []
    if not steps:
        return groups
    for rows in settings.batch_sizes:
        for index in range(settings.batched_passes):
            trees = []
            for pick in torch.randint(0, len(steps), (rows,), generator=generator).tolist():
                tree = steps[pick].tree()
                size = int(torch.randint(1, len(tree) + 1, (1,), generator=generator))
                trees.append(tree.subtree(best_first_order(tree)[:size]))
            groups.append((StepForest(tuple(trees)), "heldout" if index % 2 else "fit"))
    return groups


# 5) cost fit and its report
def _fit_cost(swept: SweepResult, table: TokenExpertTable | None, settings: ProfileSettings) -> CostFit:
    sweep, per_layer = swept.sweep, settings.per_layer_cost
    fitted = sweep.fit_samples()
    model = CostModel.fit(fitted, per_layer=per_layer)
    report = _cost_report(model, sweep.samples("grid"), sweep.samples("natural", "fit"), sweep.samples("natural", "heldout"),
                          settings)
    heldout_batched = sweep.samples("batched", "heldout")
    report["heldout_batched_error"] = _errors(model, heldout_batched)
    # the same fit with every pass taken as one row (no row term), on the same held-out batched passes
    as_one_row = CostModel.fit([replace(s, rows=1) for s in fitted], per_layer=per_layer)
    report["heldout_batched_error_without_row_term"] = _errors(as_one_row, heldout_batched)
    other = "min" if sweep.statistic == "median" else "median"
    other_model = CostModel.fit(sweep.fit_samples(other), per_layer=per_layer)
    report[f"heldout_natural_error_fitting_{other}"] = _errors(other_model, sweep.samples("natural", "heldout", other))
    if table is not None:
        # what the controller will see: experts predicted from token ids, not the recorded routing
        for pricing, predict in ((ExpertPricing.PROBABILITIES, table.predict), (ExpertPricing.TOPK, table.predict_onehot)):
            errors = [abs(model.predict(tree, predict(tree)) - timed.ms(sweep.statistic)) / timed.ms(sweep.statistic)
                      for tree, timed in swept.heldout_natural]
            report[f"heldout_natural_error_predicted_experts_{pricing.value}"] = _summary(errors)
    return CostFit(model, report)


def _aligned_to_loop(cost: CostFit, target: TargetModel, drafter: Drafter, prompts, decoded: Decoded,
                     settings: ProfileSettings, progress: Progress) -> CostFit:
    """`cost` mapped onto the loop's own passes of the fit prompts; the report compares both
    models on the held-out prompts' loop passes."""
    tick = progress("timing verify passes in the decode loop", len(prompts))
    passes = loop_passes(target, drafter, prompts, decoded.held_out, settings.max_new_tokens,
                         settings.candidate_budget, tick)
    mapping = fit_loop_map(cost.model, passes.fit or passes.heldout)
    aligned = mapping.apply(cost.model)
    report = dict(cost.report)
    report["loop_alignment"] = {
        **mapping.to_dict(),
        "sweep_model": cost.model.to_dict(),
        "heldout_loop_error_sweep_model": _errors(cost.model, passes.heldout),
        "heldout_loop_error": _errors(aligned, passes.heldout),
        "heldout_loop_passes": len(passes.heldout),
    }
    return CostFit(aligned, report)


def _summary(errors: Sequence[float]) -> dict:
    if not len(errors):
        return {"n": 0, "median": None, "p90": None}
    return {"n": len(errors), "median": float(np.median(errors)), "p90": float(np.percentile(errors, 90))}


def _errors(model: CostModel, samples: Sequence[CostSample]) -> dict:
    return _summary(relative_errors(model, samples) if samples else [])


def _cost_report(model: CostModel, grid, fit_natural, heldout_natural, settings: ProfileSettings) -> dict:
    fitted = grid + fit_natural
    tokens_only = CostModel.fit([CostSample(s.num_tokens, tuple(0 for _ in s.unique_experts), s.ms) for s in fitted])
    grid_only = CostModel.fit(grid) if grid else model
    other = CostModel.fit(fitted, per_layer=not settings.per_layer_cost)
    return {
        "fit_samples": len(fitted),
        "r2_fit": r_squared(model, fitted),
        "r2_tokens_only": r_squared(tokens_only, fitted),
        "grid_error": _errors(model, grid),
        "heldout_natural_error": _errors(model, heldout_natural),
        "grid_only_model_heldout_natural_error": _errors(grid_only, heldout_natural),
        "tokens_only_heldout_natural_error": _errors(tokens_only, heldout_natural),
        ("shared" if settings.per_layer_cost else "per_layer") + "_expert_cost_heldout_natural_error": _errors(other, heldout_natural),
    }


# 6) assemble
def _draft_cost(drafter: Drafter, trace: PromptTrace, settings: ProfileSettings):
    default = settings.candidate_budget or drafter.default_budget
    depths = sorted({d for d in (1, 2, 3, default.max_depth // 2, default.max_depth) if d >= 1})
    nodes = sorted({n for n in (1, default.max_nodes // 4, default.max_nodes // 2, default.max_nodes) if n >= 1})
    budgets = [TreeBudget(n, d, default.branching) for d in depths for n in nodes]
    root = int(trace.tokens[-1])
    return draft_cost(drafter, root, budgets, settings.timing)


def _measurement(target: TargetModel, decoded: Decoded, settings: ProfileSettings, drafter_description: str,
                 seconds: float) -> dict:
    return {
        "prompts": len(decoded.traces),
        "held_out_prompts": sorted(decoded.held_out),
        "settings": _settings_dict(settings),
        "drafter": drafter_description,
        "acceptance": "greedy",
        "experts_implementation": getattr(target.model.config, "_experts_implementation", None),
        "attn_implementation": getattr(target.model.config, "_attn_implementation", None),
        "cold_weights": settings.timing.evict_mb > 0,
        "decode_seconds": decoded.seconds,
        "total_seconds": seconds,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _settings_dict(settings: ProfileSettings) -> dict:
    data = asdict(settings)
    data["candidate_budget"] = asdict(settings.candidate_budget) if settings.candidate_budget else None
    return data
