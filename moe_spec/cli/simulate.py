"""`moe-spec simulate`: replay a `bench --trace` under other cost models. A SIMULATION, not a measurement.

    moe-spec bench --prompts configs/bench/heldout.jsonl --methods ar,eagle2 --trace runs/trace.jsonl
    moe-spec simulate --trace runs/trace.jsonl --cost-model profile,analytic:pcie-offload \\
        --per-expert-scale 1,2,4,8 --json runs/simulate.json

`--cost-model` takes a comma-separated list of `profile` (the profile's measured model),
`analytic:DEVICE` (see `analytic_cost.DEVICES`), a JSON file holding a cost model
(`CostModel.to_dict`) or a profile JSON (its measured cost model alone: e.g. one measured on another
device for a model of the traced one's shapes, `moe-spec make-random --shape embedded`); each is run at every `--per-expert-scale` S (per-expert cost times S). Prints
one table per cost model and scale, each followed by its gap decomposition (`bounds.decomposition`:
how much drafting, routing prediction, calibration and selection cost, as ratios of replayed
throughputs on the same steps) and, for a greedy trace with `moe-aware` asked, the bound replayed
(`bound_replay`: its bandit choosing among its arms' replays, against the best of them), then one JSON line with a `decomposition` section (per result, and
the profile's cost-model error against the trace's measured verify times); `--json` writes
everything, `--plots` draws speedup against S. See `replay.py` and `bounds.py` for what is and is
not modelled; every bound and oracle is a replay, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from pathlib import Path

from moe_spec.cli.json_output import add_json_argument, write_json
from moe_spec.cli.option_types import positive_float, positive_int
from moe_spec.experiments.report import format_table
from moe_spec.profile.cost_model import CostModel
from moe_spec.errors import InputError
from moe_spec.offload.resident_cache import Eviction
from moe_spec.experiments.analytic_cost import DEVICES, ModelShapes, analytic_cost_model, analytic_terms, scaled_expert_cost
from moe_spec.experiments.bound_replay import BOUNDED
from moe_spec.experiments.bounds import decomposition
from moe_spec.experiments.replay import (
    DEFAULT_POLICIES, DRAFT_TIMES, check_greedy_trace, draft_factor, measured_cost_error, parse_policies, recorded_step,
    simulate, summarise,
)
from moe_spec.experiments.trace_file import Trace, read_trace
from moe_spec.policy.bounded_controller import SIZED
from moe_spec.policy.registry import method_names

LABEL = "SIMULATION"
NOTE = ("SIMULATION: verify times are predicted by the cost model named, on the routing recorded in the trace; "
        "not measured. Policies replay EAGLE-2's recorded steps with online corrections off.")
MISSES_COLUMN = ("miss/tok", "misses_per_token", "{:.2f}")
OFFLOAD_NOTE = ("offloaded: each policy's passes go through its own cache of the resident experts, cold at each "
                "prompt (the prefill not replayed), and pay the profile's fetch time for their misses")
COLUMNS = (
    ("sim tok/s", "tokens_per_s", "{:.1f}"),
    ("sim speedup", "speedup_vs_ar", "{:.2f}x"),
    ("accept", "mean_accept_len", "{:.2f}"),
    ("tree", "mean_tree_size", "{:.1f}"),
    ("sim verify ms", "verify_ms", "{:.4g}"),
    ("draft ms", "draft_ms", "{:.4g}"),
    ("experts/layer", "unique_experts_per_layer", "{:.1f}"),
    ("loads/token", "expert_loads_per_token", "{:.1f}"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", required=True, help="JSON-lines trace written by `moe-spec bench --trace`")
    parser.add_argument("--profile", default=None, help="profile JSON (default: the one copied beside the trace)")
    parser.add_argument("--cost-model", default="profile",
                        help="comma-separated: profile, analytic:DEVICE (" + ", ".join(DEVICES) + "), a cost-model JSON file "
                             "or a profile JSON (its cost model)")
    parser.add_argument("--per-expert-scale", type=_scales, default=(1.0,),
                        help="comma-separated factors for the per-expert cost, e.g. 1,2,4,8")
    parser.add_argument("--methods", default=",".join(DEFAULT_POLICIES),
                        help=f"comma-separated: {method_names()}")
    parser.add_argument("--model", default=None, help="model folder whose config.json gives the shapes for analytic "
                                                       "cost models (default: the traced model)")
    parser.add_argument("--context-tokens", type=positive_int, default=None,
                        help="KV-cache length for analytic cost models (default: the trace's mean prefix length)")
    parser.add_argument("--bytes-per-param", type=positive_float, default=None,
                        help="weight bytes per parameter for analytic cost models (default: the device's, bf16)")
    parser.add_argument("--draft-time", default="scaled", choices=DRAFT_TIMES,
                        help="scaled: recorded draft time times the simulated / profiled non-expert cost (default); "
                             "recorded: as measured; zero: free drafting")
    parser.add_argument("--resident-experts", type=positive_int, default=None, metavar="C",
                        help="experts offloaded behind a resident cache of C per MoE layer: each pass also pays the "
                             "cost model's fetch term for its misses (the cost model must have one: a profile from "
                             "scripts/profile_fetch.py; default: every expert resident)")
    parser.add_argument("--eviction", default=Eviction.LRU.value, choices=[e.value for e in Eviction],
                        help="the replayed cache's eviction, with --resident-experts (default: lru, as offloading's)")
    add_json_argument(parser, "the full simulation report")
    parser.add_argument("--plots", default=None, help="folder for PNG figures (speedup against per-expert scale)")


def _scales(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from error
    if not values or min(values) <= 0 or not all(math.isfinite(v) for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def run(args: argparse.Namespace) -> dict:
    policies = parse_policies(args.methods)
    trace = read_trace(args.trace)
    if trace.greedy:
        check_greedy_trace(trace)
    profile = trace.profile(args.profile)
    results = []
    for base, terms in cost_models(args.cost_model, trace, profile, args):
        for scale in args.per_expert_scale:
            cost = scaled_expert_cost(base, scale)
            replays = simulate(trace, profile, cost, policies, args.draft_time, args.resident_experts,
                               Eviction(args.eviction))
            results.append({"cost_model": cost.to_dict(), "per_expert_scale": scale, "analytic_terms": terms,
                            "draft_time": args.draft_time,
                            "draft_time_factor": round(draft_factor(args.draft_time, cost, profile.cost_model), 6),
                            "policies": {name: r.figures for name, r in replays.items()},
                            "decomposition": decomposition({name: r.figures for name, r in replays.items()})})
    recorded = summarise([recorded_step(step) for step in trace.steps])
    report = {
        "simulation": True,
        "note": NOTE,
        "acceptance": "exact (greedy trace)" if trace.greedy else "approximate (sampled trace: recorded path cut to the subtree)",
        "offload": None if args.resident_experts is None else {"resident_experts": args.resident_experts,
                                                                "eviction": args.eviction, "note": OFFLOAD_NOTE},
        "trace": str(args.trace),
        "trace_method": trace.header.get("method"),
        "steps": len(trace.steps),
        "prompts": len({s.rows[0] for s in trace.steps}),
        "recorded": {"eagle2": recorded, "note": "measured on the tracing machine, for comparison (not simulated)"},
        # the bench's own profile (beside the trace) against the times that bench measured, whatever --profile is
        "cost_model_error": measured_cost_error(trace, profile if args.profile is None else trace.profile()),
        "results": results,
    }
    print(format_report(report))
    write_json(args.json_out, report)
    if args.plots is not None:
        from moe_spec.experiments.simulate_plots import plot_speedup_vs_scale

        report["plots"] = [str(p) for p in plot_speedup_vs_scale(report, Path(args.plots))]
    line = {
        "command": "simulate", "simulation": True, "json": args.json_out,
        "results": [{"cost_model": r["cost_model"]["source"], "per_expert_scale": r["per_expert_scale"],
                     "speedup_vs_ar": {name: f["speedup_vs_ar"] for name, f in r["policies"].items()}} for r in results],
        "decomposition": {
            "results": [{"cost_model": r["cost_model"]["source"], "per_expert_scale": r["per_expert_scale"],
                         **r["decomposition"]} for r in results],
            "cost_model_error": report["cost_model_error"],
        },
    }
    print(json.dumps(line))
    return report


def cost_models(spec: str, trace: Trace, profile, args: argparse.Namespace) -> list[tuple[CostModel, dict | None]]:
    """(cost model, analytic terms or None) for each entry of `--cost-model`."""
    models = []
    for entry in [e.strip() for e in spec.split(",") if e.strip()]:
        if entry == "profile":
            models.append((profile.cost_model, None))
        elif entry.startswith("analytic:"):
            models.append(_analytic(entry.removeprefix("analytic:"), trace, profile, args))
        else:
            models.append((_cost_model_file(Path(entry), profile), None))
    if not models:
        raise InputError("no cost model given; e.g. --cost-model profile,analytic:pcie-offload")
    return models


def _analytic(name: str, trace: Trace, profile, args: argparse.Namespace) -> tuple[CostModel, dict]:
    from transformers import AutoConfig

    from moe_spec.loading import model_folder

    if name not in DEVICES:
        raise InputError(f"unknown device {name!r} for an analytic cost model; known: {', '.join(DEVICES)}")
    device = DEVICES[name] if args.bytes_per_param is None else replace(DEVICES[name], bytes_per_param=args.bytes_per_param)
    folder = args.model or trace.header.get("bench_config", {}).get("model")
    if folder is None:
        raise InputError("the trace names no model folder; pass --model for the analytic cost model's shapes")
    shapes = ModelShapes.from_config(AutoConfig.from_pretrained(model_folder(folder)), profile.cost_model.num_layers)
    context = args.context_tokens
    if context is None:
        context = round(sum(s.prefix_lens[0] for s in trace.steps) / len(trace.steps))
    return analytic_cost_model(shapes, device, context), analytic_terms(shapes, device, context)


def _cost_model_file(path: Path, profile) -> CostModel:
    try:
        document = json.loads(path.read_text())
        if isinstance(document, dict) and "fingerprint" in document:  # a profile: its measured cost model
            document = {**document["cost_model"], "source": f"profile {path.name}"}
        cost = CostModel.from_dict(document)
    except OSError as error:
        raise InputError(f"--cost-model {path}: not 'profile', 'analytic:DEVICE' or a readable file ({error.strerror})") from None
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
        raise InputError(f"--cost-model {path}: not a cost model JSON ({type(error).__name__}: {error})") from None
    if cost.num_layers != profile.cost_model.num_layers:
        raise InputError(f"--cost-model {path} has {cost.num_layers} MoE layers, the traced target {profile.cost_model.num_layers}")
    return cost


def format_report(report: dict) -> str:
    recorded = report["recorded"]["eagle2"]
    lines = [
        f"=== {LABEL} === {report['steps']} recorded {report['trace_method']} steps over {report['prompts']} prompts "
        f"from {report['trace']}; acceptance {report['acceptance']}",
        NOTE,
        f"recorded on the tracing machine (measured, decode only): eagle2 {recorded['tokens_per_s']:.1f} tok/s, "
        f"accept {recorded['mean_accept_len']:.2f}, verify {recorded['verify_ms']:.3f} ms, draft {recorded['draft_ms']:.3f} ms",
    ]
    offload = report.get("offload")
    if offload is not None:
        lines.append(f"{LABEL} | {offload['resident_experts']} experts resident per layer ({offload['eviction']}); "
                     f"{offload['note']}")
    for result in report["results"]:
        cost = result["cost_model"]
        experts = ", ".join(f"{v:.4g}" for v in cost["per_expert_ms"])
        title = (f"{LABEL} | cost model {cost['source']}: {cost['base_ms']:.4g} ms + {cost['per_token_ms']:.4g} ms/token "
                 f"+ [{experts}] ms/expert-layer")
        title += f"; draft time {result['draft_time']} (x{result['draft_time_factor']:.4g})"
        columns = COLUMNS if report.get("offload") is None else (*COLUMNS, MISSES_COLUMN)
        table = format_table(result["policies"], title, columns)
        best = result["policies"].get("static-best", {}).get("budget")
        lines += ["", table + (f"\n(static-best = {best})" if best else "")]
        if BOUNDED in result["policies"]:
            lines.append(format_bound(result["policies"][BOUNDED]))
        if result["decomposition"]:
            lines += ["", format_decomposition(result["decomposition"], report["cost_model_error"])]
    return "\n".join(lines)


def format_bound(figures: dict) -> str:
    """The bound's replay against its own arms: what choosing online cost, and who decided."""
    arms, best = figures["arm_tokens_per_s"], figures["best_arm"]
    shares = ", ".join(f"{arm} {share:.0%}" for arm, share in figures["decisions"].items())
    return (f"{BOUNDED}: {figures['tokens_per_s']:.1f} tok/s, {figures['tokens_per_s'] / arms[best]:.3f}x its best arm "
            f"in hindsight ({best}, {arms[best]:.1f}), {figures['tokens_per_s'] / arms[SIZED]:.3f}x its sizing alone "
            f"(gate off, {arms[SIZED]:.1f}); steps decided by {shares}")


# (label, key) of the decomposition table's rows, in `bounds.decomposition`'s terms
DECOMPOSITION_ROWS = (
    ("drafting the candidate tree (vs sized draft)", "drafting"),
    ("routing prediction (vs true routing)", "routing"),
    ("acceptance foresight (vs realised acceptance)", "calibration"),
    ("interaction of the three", "interaction"),
    ("all three removed (all oracles)", "all_oracles"),
    ("remaining: selection (to sized ceiling)", "remaining_selection"),
    ("total gap to the sized ceiling", "total_to_sized_ceiling"),
    ("gap to the ceiling, draft as replayed", "to_ceiling"),
)


def format_decomposition(parts: dict, cost_error: dict) -> str:
    """The gap decomposition of one result: causes as rows, `moe-aware` and `static-best` as columns."""
    columns = list(parts)
    width = max(len(label) for label, _ in DECOMPOSITION_ROWS)
    lines = [f"{LABEL} | gap decomposition: ratios of replayed tok/s on the same steps (> 1: what removing the cause gains)",
             "  ".join(["cause".ljust(width)] + [c.rjust(11) for c in columns])]
    for label, key in DECOMPOSITION_ROWS:
        cells = [f"{parts[c][key]:.3f}x" if parts[c].get(key) is not None else "-" for c in columns]
        lines.append("  ".join([label.ljust(width)] + [cell.rjust(11) for cell in cells]))
    moe = parts.get("moe-aware")
    if moe is not None and moe.get("predicted_accept_len") is not None:
        lines.append(f"calibration: moe-aware's choices expected {moe['predicted_accept_len']:.3f} tokens per step, "
                     f"produced {moe['realised_accept_len']:.3f}")
    line = (f"cost model (measured: the trace's profile against its {cost_error['steps']} whole-tree verifies): mean "
            f"measured {cost_error['measured_ms']:.2f} ms, predicted " + _cost_error(cost_error["recorded_routing"])
            + " on the recorded routing")
    if cost_error["predicted_routing"] is not None:
        line += ", " + _cost_error(cost_error["predicted_routing"]) + " on the predicted routing"
    return "\n".join(lines + [line])


def _cost_error(summary: dict) -> str:
    ratio, error = summary["predicted_over_measured"], summary["median_abs_error"]
    return (f"{summary['predicted_ms']:.2f} ms (x{ratio:.3f}" if ratio is not None else f"{summary['predicted_ms']:.2f} ms (x-") \
        + (f", median |error| {error:.1%})" if error is not None else ")")
