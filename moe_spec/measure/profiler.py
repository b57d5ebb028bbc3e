"""Profiling a target: decode real prompts, time verify passes, fit, and assemble a `Profile`.

Prompts are split by index: every `heldout_every`-th prompt is held out. Fitted on the others:
the token-id expert table and the cost model; evaluated on the held-out prompts' draft trees:
the table's recall / precision and the cost model's error on natural trees. The acceptance
calibration is fitted on every step and its reliability is cross-fitted (see `calibration.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import torch

from moe_spec.profile.cost_model import CostModel, CostSample, r_squared, relative_errors
from moe_spec.core.drafting import Drafter, TreeBudget
from moe_spec.profile.artifact import Profile, fingerprint, hardware_description
from moe_spec.profile.calibration import AcceptanceCalibration, NodeSamples, cross_fitted_report
from moe_spec.profile.expert_table import TokenExpertTable, evaluate_predictor
from moe_spec.measure.latency import (
    CacheEvictor,
    TimingConfig,
    batched_prefill_cache,
    batched_verify_run,
    draft_cost,
    Timing,
    grid_configs,
    grid_runs,
    prefill_cache,
    time_round_robin,
    verify_run,
)
from moe_spec.measure.routing_stats import RoutingStats, unique_experts_curve
from moe_spec.measure.trace import PromptTrace, TracedStep, best_first_order, trace_prompt
from moe_spec.core.target import TargetModel
from moe_spec.core.tree import DraftTree

Progress = Callable[[str, int], Callable[[], None]]  # (stage description, total) -> tick


def _no_progress(description: str, total: int) -> Callable[[], None]:
    return lambda: None


@dataclass(frozen=True)
class ProfileSettings:
    max_new_tokens: int = 48  # per prompt
    candidate_budget: TreeBudget | None = None  # None: the drafter's default budget
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
    seed: int = 0

    def __post_init__(self):
        if (self.max_new_tokens < 2 or self.heldout_every < 2 or self.prefix_len < 1 or self.natural_trees < 0
                or any(rows < 1 for rows in self.batch_sizes) or self.batched_passes < 0):
            raise ValueError(f"invalid profile settings {self}")


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

    tick = progress("decoding prompts", len(prompts))
    traces = []
    for index, prompt in enumerate(prompts):
        traces.append(trace_prompt(target, drafter, prompt, settings.max_new_tokens, settings.candidate_budget, index))
        tick()
    decode_s = time.perf_counter() - start
    held_out = {i for i in range(len(prompts)) if i % settings.heldout_every == settings.heldout_every - 1}
    if not held_out and len(prompts) > 1:
        held_out = {len(prompts) - 1}
    fit_traces = [t for t in traces if t.prompt_index not in held_out]
    all_steps = [s for t in traces for s in t.steps]
    fit_steps = [s for t in fit_traces for s in t.steps]
    heldout_steps = [s for t in traces if t.prompt_index in held_out for s in t.steps]
    if not heldout_steps:  # one prompt: hold out every other step instead
        fit_steps, heldout_steps = all_steps[0::2], all_steps[1::2]

    details: dict = {
        "decoding": _decoding_summary(traces, settings),
    }
    arrays: dict[str, np.ndarray] = {}

    table = None
    if target.is_moe:
        stats = RoutingStats(target.vocab_size, len(target.routers), target.num_experts, target.top_k)
        for trace in fit_traces or traces:
            stats.add(trace.tokens, trace.experts)
        pool = torch.cat([t.experts for t in traces], dim=1)  # [L, P, K]
        curve = unique_experts_curve(all_steps, pool, settings.curve_sizes, generator)
        table = TokenExpertTable.from_stats(stats)
        predictor_report = evaluate_predictor(table, heldout_steps)
        details["routing"] = {
            "tokens": stats.num_tokens,
            "distinct_token_ids": int((stats.token_totals > 0).sum()),
            "imbalance_max_over_mean": stats.imbalance().tolist(),
            "idle_experts": stats.idle_experts().tolist(),
            "token_id_concentration": stats.token_concentration().tolist(),
            "unique_experts_curve": {
                "sizes": list(curve.sizes),
                "real": curve.real.tolist(),
                "real_trees": list(curve.real_trees),
                "random": curve.random.tolist(),
            },
        }
        soft, hard = np.mean(predictor_report.unique_relative_error or [np.inf]), np.mean(predictor_report.unique_relative_error_topk or [np.inf])
        details["expert_predictor"] = {
            "kind": "token_id_table",
            "pricing": "topk" if hard < soft else "probabilities",  # what Profile.predict_verify_ms feeds the cost model
            **predictor_report.to_dict(),
        }
        arrays["routing_load"] = stats.load
        arrays["routing_coactivation"] = stats.coactivation

    calibration = None
    samples = NodeSamples.from_steps(all_steps)
    if len(samples):
        calibration = AcceptanceCalibration.fit(samples)
        details["calibration"] = cross_fitted_report(all_steps).to_dict()

    latency_start = time.perf_counter()
    evict = CacheEvictor(settings.timing.evict_mb)
    longest = max(traces, key=lambda t: t.tokens.numel()).tokens
    prefix = longest.repeat(settings.prefix_len // longest.numel() + 1)[: settings.prefix_len]
    cache = prefill_cache(target, prefix)
    num_layers = len(target.routers)
    # grid and natural trees are timed in one interleaved sweep, so both see the same machine load
    configs = grid_configs(target, settings.grid_tokens, settings.grid_experts)
    runs = grid_runs(target, cache, configs, generator)
    chosen = _natural_trees(fit_steps, heldout_steps, settings.natural_trees)
    tokens_of = {t.prompt_index: t.tokens for t in traces}
    for step, _ in chosen:
        runs.append(verify_run(target, prefill_cache(target, tokens_of[step.prompt_index][: step.prefix_len]), step.tree))
    batched = _batched_passes(fit_steps + heldout_steps, settings, generator)
    batch_caches = {rows: batched_prefill_cache(target, prefix, rows) for rows in {len(trees) for trees, _ in batched}}
    runs += [batched_verify_run(target, batch_caches[len(trees)], trees) for trees, _ in batched]
    tick = progress(f"timing {len(runs)} verify passes (repeats)", settings.timing.repeats)
    timings = time_round_robin(runs, settings.timing, evict, tick)
    for (_, unique), timing in zip(configs, timings):
        if target.is_moe and set(timing.unique_experts) != {unique}:
            raise RuntimeError(f"forcing {unique} experts per layer gave {timing.unique_experts}")
    del cache, runs
    # (T, U, timing, split, B) per timed pass; a batched pass computes B x its widest tree's tokens
    grid_rows = [(t, (u,) * num_layers, timing, "grid", 1) for (t, u), timing in zip(configs, timings)]
    natural_rows = [
        (len(step.tree), timing.unique_experts, timing, split, 1)
        for (step, split), timing in zip(chosen, timings[len(configs): len(configs) + len(chosen)])
    ]
    batch_rows = [
        (len(trees) * max(len(t) for t in trees), timing.unique_experts, timing, f"batch-{split}", len(trees))
        for (trees, split), timing in zip(batched, timings[len(configs) + len(chosen):])
    ]
    batch_widths = [max(len(t) for t in trees) for trees, _ in batched]  # every row is padded to the widest tree
    statistic = settings.timing.statistic

    def cost_samples(rows, split: str, stat: str = statistic) -> list[CostSample]:
        return [CostSample(t, u, timing.ms(stat), b) for t, u, timing, s, b in rows if s == split]

    fitted = cost_samples(grid_rows, "grid") + cost_samples(natural_rows, "fit") + cost_samples(batch_rows, "batch-fit")
    cost_model = CostModel.fit(fitted, per_layer=settings.per_layer_cost)
    details["latency"] = {
        "statistic": statistic,
        "grid": [_timing_row(t, u[0] if u else 0, timing, statistic) for t, u, timing, _, _ in grid_rows],
        "natural_trees": [{**_timing_row(t, list(u), timing, statistic), "split": s} for t, u, timing, s, _ in natural_rows],
        "batched_passes": [
            {**_timing_row(t, list(u), timing, statistic), "B": b, "width": w, "split": s}
            for (t, u, timing, s, b), w in zip(batch_rows, batch_widths)
        ],
        "prefix_len": settings.prefix_len,
        "seconds": time.perf_counter() - latency_start,
    }
    details["cost_model_report"] = _cost_report(
        cost_model, cost_samples(grid_rows, "grid"), cost_samples(natural_rows, "fit"), cost_samples(natural_rows, "heldout"), settings
    )
    heldout_batched = cost_samples(batch_rows, "batch-heldout")
    details["cost_model_report"]["heldout_batched_error"] = _errors(cost_model, heldout_batched)
    # the same fit with every pass taken as one row (no row term), on the same held-out batched passes
    as_one_row = CostModel.fit([replace(s, rows=1) for s in fitted], per_layer=settings.per_layer_cost)
    details["cost_model_report"]["heldout_batched_error_without_row_term"] = _errors(as_one_row, heldout_batched)
    other = "min" if statistic == "median" else "median"
    other_model = CostModel.fit(
        cost_samples(grid_rows, "grid", other) + cost_samples(natural_rows, "fit", other) + cost_samples(batch_rows, "batch-fit", other),
        per_layer=settings.per_layer_cost,
    )
    details["cost_model_report"][f"heldout_natural_error_fitting_{other}"] = _errors(
        other_model, cost_samples(natural_rows, "heldout", other)
    )
    if table is not None:
        # what the controller will see: experts predicted from token ids, not the recorded routing
        heldout = [(step, timing) for (step, split), timing in zip(chosen, timings[len(configs):]) if split == "heldout"]
        for name, predict in (("probabilities", table.predict), ("topk", table.predict_onehot)):
            errors = [abs(cost_model.predict(step.tree, predict(step.tree)) - timing.ms(statistic)) / timing.ms(statistic)
                      for step, timing in heldout]
            details["cost_model_report"][f"heldout_natural_error_predicted_experts_{name}"] = (
                {"n": len(errors), "median": float(np.median(errors)), "p90": float(np.percentile(errors, 90))}
                if errors else {"n": 0, "median": None, "p90": None}
            )
    if drafter is not None and all_steps:
        details["draft_cost"] = _draft_cost(drafter, traces[-1], settings).to_dict()
    details["measurement"] = {
        "prompts": len(prompts),
        "held_out_prompts": sorted(held_out),
        "settings": _settings_dict(settings),
        "drafter": drafter_description,
        "acceptance": "greedy",
        "experts_implementation": _experts_implementation(target),
        "attn_implementation": getattr(target.model.config, "_attn_implementation", None),
        "cold_weights": settings.timing.evict_mb > 0,
        "decode_seconds": decode_s,
        "total_seconds": time.perf_counter() - start,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    return Profile(
        fingerprint=fingerprint(target),
        hardware=hardware_description(target.device),
        cost_model=cost_model,
        calibration=calibration,
        expert_table=table,
        details=details,
        arrays=arrays,
    )


def _decoding_summary(traces: Sequence[PromptTrace], settings: ProfileSettings) -> dict:
    steps = [s for t in traces for s in t.steps]
    if not steps:
        return {"steps": 0}
    return {
        "steps": len(steps),
        "new_tokens": sum(len(s.path) for s in steps) + len(traces),
        "mean_candidate_nodes": float(np.mean([s.tree.num_drafted for s in steps])),
        "mean_accept_len": float(np.mean([len(s.path) for s in steps])),  # includes the bonus token
        "mean_verify_ms": float(np.mean([s.verify_ms for s in steps])),
        "mean_draft_ms": float(np.mean([s.draft_ms for s in steps])),
    }


def _batched_passes(steps, settings: ProfileSettings, generator: torch.Generator) -> list[tuple[list[DraftTree], str]]:
    """For each batch size B, `batched_passes` groups of B recorded trees (drawn at random, each cut to a
    random best-first prefix, as a controller would cut it), half held out."""
    groups = []
    if not steps:
        return groups
    for rows in settings.batch_sizes:
        for index in range(settings.batched_passes):
            trees = []
            for pick in torch.randint(0, len(steps), (rows,), generator=generator).tolist():
                tree = steps[pick].tree
                size = int(torch.randint(1, len(tree) + 1, (1,), generator=generator))
                trees.append(tree.subtree(best_first_order(tree)[:size]))
            groups.append((trees, "heldout" if index % 2 else "fit"))
    return groups


def _natural_trees(fit_steps, heldout_steps, count: int) -> list[tuple[TracedStep, str]]:
    """Recorded draft trees to time on their own context, half from held-out prompts."""
    half = count // 2
    return [(s, "fit") for s in _spread(fit_steps, count - half)] + [(s, "heldout") for s in _spread(heldout_steps, half)]


def _timing_row(num_tokens: int, unique, timing: Timing, statistic: str) -> dict:
    return {"T": num_tokens, "U": unique, "ms": timing.ms(statistic), "ms_median": timing.median_ms, "ms_min": timing.min_ms}


def _spread(steps: Sequence[TracedStep], count: int) -> list[TracedStep]:
    """Up to `count` steps spread evenly over tree sizes (the largest trees matter most)."""
    if count <= 0 or not steps:
        return []
    ordered = sorted(steps, key=lambda s: len(s.tree))
    if len(ordered) <= count:
        return ordered
    picks = np.unique(np.linspace(0, len(ordered) - 1, count).round().astype(int))
    return [ordered[i] for i in picks]


def _errors(model: CostModel, samples: Sequence[CostSample]) -> dict:
    if not samples:
        return {"n": 0, "median": None, "p90": None}
    e = relative_errors(model, samples)
    return {"n": len(samples), "median": float(np.median(e)), "p90": float(np.percentile(e, 90))}


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


def _draft_cost(drafter: Drafter, trace: PromptTrace, settings: ProfileSettings):
    default = settings.candidate_budget or drafter.default_budget
    depths = sorted({d for d in (1, 2, 3, default.max_depth // 2, default.max_depth) if d >= 1})
    nodes = sorted({n for n in (1, default.max_nodes // 4, default.max_nodes // 2, default.max_nodes) if n >= 1})
    budgets = [TreeBudget(n, d, default.branching) for d in depths for n in nodes]
    root = int(trace.tokens[-1])
    return draft_cost(drafter, root, budgets, settings.timing)


def _settings_dict(settings: ProfileSettings) -> dict:
    data = asdict(settings)
    data["candidate_budget"] = asdict(settings.candidate_budget) if settings.candidate_budget else None
    return data


def _experts_implementation(target: TargetModel):
    return getattr(target.model.config, "_experts_implementation", None)
