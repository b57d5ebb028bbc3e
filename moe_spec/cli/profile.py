"""`moe-spec profile`: measure a target on this machine and write a reusable profile.

    moe-spec profile --prompts prompts.jsonl --out profile.json [--model DIR] [--drafter DIR] [--plots DIR]

The prompts file holds one JSON object per line with a `prompt` string (text, encoded with the
model's tokenizer) or a `prompt_ids` list. Progress bars go to stderr; stdout gets a summary
table and, last, one JSON line for machines.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from moe_spec.cli.model_options import add_model_arguments, resolve_model_options
from moe_spec.cli.defaults import field_defaults
from moe_spec.cli.offload_options import add_offload_arguments, offload_config, offload_from_args
from moe_spec.cli.option_types import experts_implementation, non_negative_int, positive_int, seed
from moe_spec.core.drafting import EAGLE2_BUDGET, TreeBudget
from moe_spec.core.sampling import GREEDY
from moe_spec.errors import InputError
from moe_spec.loading import load_drafter, load_target, load_tokenizer, model_folder
from moe_spec.experiments.prompt_file import in_class_turns, load_prompts
from moe_spec.profile.artifact import Profile
from moe_spec.profile.cost_model import CostModel
from moe_spec.measure.latency import TimingConfig
from moe_spec.measure.arm_rates_stage import arm_rates_stage
from moe_spec.measure.fetch_profile import fetch_stage
from moe_spec.measure.profiler import ProfileSettings, build_profile
from moe_spec.measure.store import cached_profile_path
from moe_spec.core.target import TargetModel

SETTINGS = field_defaults(ProfileSettings)
ARM_PROMPTS = 12  # prompts the arm stage decodes with each arm
ARM_NEW_TOKENS = 32  # at least, so that steps remain past each request's settling steps
TIMING = field_defaults(TimingConfig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=None, help="target model folder (default: the embedded target)")
    parser.add_argument(
        "--drafter", default="default",
        help="a drafter: 'lookup', 'mtp' (the checkpoint's own MTP layers), 'default' (the embedded EAGLE-3 head), or a "
             "folder holding an EAGLE-3 head (any published layout) or a causal LM sharing the target's tokenizer",
    )
    parser.add_argument("--prompts", type=Path, required=True, help="JSONL file, one {\"prompt\": ...} per line")
    parser.add_argument("--out", type=Path, required=True, help="profile JSON to write (arrays go beside it as .npz)")
    parser.add_argument("--plots", type=Path, default=None, help="folder for PNG figures")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's setting)")
    parser.add_argument("--experts-implementation", type=experts_implementation, default="grouped_mm",
                        help="transformers' (grouped_mm, batched_mm, eager) or megablocks where installed")
    add_model_arguments(parser)
    parser.add_argument("--evict-mb", type=non_negative_int, default=TIMING["evict_mb"],
                        help="buffer written before each timed run (0: warm caches)")
    parser.add_argument(
        "--statistic", default=TIMING["statistic"], choices=("min", "median"),
        help="of the timed repeats (both are stored); 'min' resists load from other jobs on a shared machine",
    )
    parser.add_argument("--per-layer-cost", action="store_true", help="fit one expert cost per MoE layer")
    parser.add_argument("--arm-rates", action=argparse.BooleanOptionalAction, default=True,
                        help="measure each arm moe-aware chooses among (fixed budgets, its sizing, plain decoding) "
                             "on up to 12 prompts, greedy: the prior its bandit starts from; needs a drafter")
    parser.add_argument("--loop-alignment", action=argparse.BooleanOptionalAction, default=SETTINGS["loop_alignment"],
                        help="map the sweep's cost model onto verify passes timed in the decode loop, at every size "
                             "a controller verifies (what the loop pays: weights warm, mean times); needs a drafter")
    parser.add_argument("--seed", type=seed, default=SETTINGS["seed"])
    add_offload_arguments(parser)  # with --offload: the profile also measures the fetch cost of that tier
    size = parser.add_argument_group("how much to measure (smaller: a quicker, rougher profile)")
    size.add_argument("--max-new-tokens", type=positive_int, default=SETTINGS["max_new_tokens"],
                      help="tokens decoded per prompt for acceptance and routing statistics")
    size.add_argument("--max-prompts", type=positive_int, default=None, help="use only the first N prompts, the classes taking turns (default: all)")
    size.add_argument("--repeats", type=positive_int, default=TIMING["repeats"], help="timed runs of each verify pass")
    size.add_argument("--warmup", type=non_negative_int, default=TIMING["warmup"], help="untimed runs before them")
    size.add_argument("--grid-tokens", type=_int_list, default=SETTINGS["grid_tokens"],
                      help="verified tokens T of the latency grid")
    size.add_argument("--grid-experts", type=_int_list, default=SETTINGS["grid_experts"],
                      help="unique experts per layer U of the latency grid (forced routing; infeasible pairs skipped)")
    size.add_argument("--natural-trees", type=non_negative_int, default=SETTINGS["natural_trees"],
                      help="drafted trees timed as decoded, for the fit and its held-out error")
    size.add_argument("--batch-sizes", type=_int_list, default=SETTINGS["batch_sizes"],
                      help="rows of the batched passes timed for the per-row term")
    size.add_argument("--prefix-len", type=positive_int, default=SETTINGS["prefix_len"],
                      help="cached context under the latency grid")
    size.add_argument("--tree-nodes", type=positive_int, default=None,
                      help="candidate tree nodes while decoding (default: the drafter's own budget)")
    size.add_argument("--tree-depth", type=positive_int, default=None,
                      help="candidate tree depth while decoding (default: the drafter's own budget)")


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from error
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def run(args: argparse.Namespace) -> dict:
    """Profile, write the profile (and plots), print the summary; returns the final JSON record."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model_dir = model_folder(args.model)
    offloading = offload_config(args)  # checked before anything loads
    resolve_model_options(args)
    target = TargetModel(load_target(model_dir, args.dtype, args.experts_implementation, device=args.device,
                                     device_map=args.device_map))
    tokenizer = load_tokenizer(model_dir)
    drafter = load_drafter(args.drafter, target)
    drafter_description = args.drafter
    prompts = read_prompts(args.prompts, tokenizer, target.vocab_size)
    if args.max_prompts is not None:
        prompts = prompts[: args.max_prompts]
    budget = None
    if args.tree_nodes is not None or args.tree_depth is not None:
        base = drafter.default_budget if drafter is not None else EAGLE2_BUDGET
        budget = TreeBudget(args.tree_nodes or base.max_nodes, args.tree_depth or base.max_depth, base.branching)
    settings = ProfileSettings(
        max_new_tokens=args.max_new_tokens,
        candidate_budget=budget,
        prefix_len=args.prefix_len,
        grid_tokens=args.grid_tokens,
        grid_experts=args.grid_experts,
        natural_trees=args.natural_trees,
        batch_sizes=args.batch_sizes,
        timing=TimingConfig(args.repeats, args.warmup, args.evict_mb, args.statistic),
        per_layer_cost=args.per_layer_cost,
        loop_alignment=args.loop_alignment,
        seed=args.seed,
    )
    start = time.perf_counter()
    profile = build_profile(target, drafter, prompts, settings, _tqdm_progress, drafter_description)
    if args.arm_rates and drafter is not None:
        profile = _with_arm_rates(profile, target, drafter, prompts, args)
    if offloading is not None:
        # the compute terms above were measured with every expert resident; the fetch term is this tier's
        target.offload = offload_from_args(args, target.model)
        try:
            profile = fetch_stage(target, drafter, prompts[:4], profile, max_new_tokens=min(args.max_new_tokens, 24),
                                  progress=lambda runs: tqdm(runs, desc="fetch check", file=sys.stderr, leave=False))
            if args.arm_rates and drafter is not None:
                profile = _with_arm_rates(profile, target, drafter, prompts, args)
        finally:
            target.offload.close()
    profile.details["measurement"]["model"] = str(model_dir)
    profile.details["measurement"]["prompts_sha256"] = hashlib.sha256(args.prompts.read_bytes()).hexdigest()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    sidecar = profile.save(args.out)
    cached = cached_profile_path(target, args.drafter)
    if cached.resolve() != args.out.resolve():  # where generate and bench look for this target's profile
        profile.save(cached)
        print(f"profile cached for generate and bench at {cached}", file=sys.stderr)
    plots = write_plots(profile, args.plots) if args.plots is not None else []
    print(summary_table(profile))
    report = profile.details.get("cost_model_report", {})
    record = {
        "profile": str(args.out),
        "arrays": str(sidecar),
        "seconds": round(time.perf_counter() - start, 2),
        "cost_model": profile.cost_model.to_dict(),
        "heldout_median_rel_error": report.get("heldout_natural_error", {}).get("median"),
        "heldout_p90_rel_error": report.get("heldout_natural_error", {}).get("p90"),
        "heldout_batched_median_rel_error": report.get("heldout_batched_error", {}).get("median"),
        "heldout_batched_p90_rel_error": report.get("heldout_batched_error", {}).get("p90"),
        "arm_rates": [entry.to_dict() for entry in profile.arm_rates],
        "loop_alignment": {k: v for k, v in report["loop_alignment"].items() if k != "sweep_model"}
                          if "loop_alignment" in report else None,
        "calibration": profile.details.get("calibration"),
        "predictor_node_recall": profile.details.get("expert_predictor", {}).get("node_recall"),
        "plots": [str(p) for p in plots],
    }
    if "fetch_cost_report" in profile.details:
        fetch = profile.details["fetch_cost_report"]
        record["fetch_error_median"] = fetch.get("error_refit_with_fetch_term", {}).get("median")
        record["fetch_error_compute_only_median"] = fetch.get("error_compute_only", {}).get("median")
    print(json.dumps(record))
    return record


def _with_arm_rates(profile: Profile, target: TargetModel, drafter, prompts, args) -> Profile:
    """`profile` with moe-aware's arms measured greedily on (up to 12 of) its prompts, on `target` as
    it is now (offloaded or resident; the other kind's entries are kept)."""
    chosen = prompts[:ARM_PROMPTS]
    tick = _tqdm_progress("arm rates", len(chosen))
    entries = arm_rates_stage(target, drafter, profile, chosen, [GREEDY], max(args.max_new_tokens, ARM_NEW_TOKENS),
                              seed=args.seed, tick=tick)
    offloaded = target.offload is not None
    kept = tuple(e for e in profile.arm_rates if (e.resident_experts is not None) != offloaded)
    return dataclasses.replace(profile, arm_rates=kept + entries)


def read_prompts(path: Path, tokenizer, vocab_size: int) -> list[torch.Tensor]:
    """[T] long token ids per prompt of a prompt file (`moe_spec.experiments.prompt_file`), checked
    against the vocabulary, with the classes taking turns (`in_class_turns`): the stages that decode
    only the first few (the fetch and arm stages) see every class alike."""
    prompts = []
    for number, prompt in enumerate(in_class_turns(load_prompts(path)), 1):
        ids = prompt.input_ids(tokenizer)[0]
        if bool(((ids < 0) | (ids >= vocab_size)).any()):
            raise InputError(f"{path}: prompt {number} has token ids outside [0, {vocab_size})")
        prompts.append(ids)
    return prompts


def _tqdm_progress(description: str, total: int):
    bar = tqdm(total=total, desc=description, file=sys.stderr, leave=False, dynamic_ncols=True)

    def tick() -> None:
        bar.update(1)
        if bar.n >= bar.total:
            bar.close()

    if total == 0:
        bar.close()
    return tick


def write_plots(profile: Profile, folder: Path) -> list[Path]:
    from moe_spec.measure import plots
    from moe_spec.measure.sweep import LatencySweep

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    if profile.unique_experts_curve is not None:
        written.append(folder / "unique_experts_vs_tokens.png")
        plots.plot_unique_experts(profile.unique_experts_curve, profile.fingerprint["num_experts"], written[-1])
    sweep = LatencySweep.from_dict(profile.details["latency"], profile.cost_model.num_layers)
    if sweep.of_kind("grid"):
        written.append(folder / "latency_heatmap.png")
        plots.plot_latency_heatmap(sweep, written[-1])
    written.append(folder / "cost_model_residuals.png")
    # the sweep's passes against the sweep's model (the profile's own is it mapped onto the loop)
    loop = profile.details.get("cost_model_report", {}).get("loop_alignment")
    plots.plot_residuals(CostModel.from_dict(loop["sweep_model"]) if loop else profile.cost_model, sweep, written[-1])
    if "routing_load" in profile.arrays:
        load = profile.arrays["routing_load"]
        written.append(folder / "expert_load.png")
        plots.plot_expert_load(load / load.sum(axis=1, keepdims=True).clip(min=1), written[-1])
    return written


def summary_table(profile: Profile) -> str:
    d = profile.details
    cm = profile.cost_model
    rows = [("target", f"{profile.fingerprint['model_type']}  {profile.fingerprint['num_parameters'] / 1e6:.1f}M params  "
                       f"{profile.fingerprint['dtype']}  {d['measurement']['experts_implementation']}"),
            ("hardware", f"{profile.hardware['cpu']}  threads={profile.hardware['torch_threads']}  "
                         f"cold={d['measurement']['cold_weights']}")]
    dec = d["decoding"]
    if dec.get("steps"):
        rows.append(("decoding", f"{dec['steps']} steps  candidate nodes {dec['mean_candidate_nodes']:.1f}  "
                                 f"accept len {dec['mean_accept_len']:.2f}  verify {dec['mean_verify_ms']:.1f} ms"))
    experts = ", ".join(f"{v:.4f}" for v in cm.per_expert_ms)
    rows.append(("cost model", f"{cm.base_ms:.3f} ms + {cm.per_row_ms:.3f} ms/extra row + {cm.per_token_ms:.4f} ms/token "
                               f"+ [{experts}] ms/expert-layer"))
    report = d["cost_model_report"]
    held = report["heldout_natural_error"]
    if held["n"]:
        rows.append(("cost error", f"held-out natural trees (n={held['n']}): median {held['median']:.1%}  p90 {held['p90']:.1%}  "
                                   f"R2 {report['r2_fit']:.3f} (tokens only {report['r2_tokens_only']:.3f})"))
    loop = report.get("loop_alignment")
    if loop is not None:
        before, after = loop["heldout_loop_error_sweep_model"], loop["heldout_loop_error"]
        rows.append(("loop alignment", f"sweep model x {loop['factor']:.3f} {loop['offset_ms']:+.3f} ms fixed, from "
                                       f"{loop['passes'] - loop['dropped']} loop passes ({loop['dropped']} outliers left out); "
                                       f"held-out loop passes (n={after['n']}): median error {before['median']:.1%} -> "
                                       f"{after['median']:.1%}, p90 {before['p90']:.1%} -> {after['p90']:.1%}"))
    batched = report.get("heldout_batched_error", {"n": 0})
    if batched["n"]:
        without = report["heldout_batched_error_without_row_term"]
        rows.append(("batched error", f"held-out batched passes (n={batched['n']}): median {batched['median']:.1%}  "
                                      f"p90 {batched['p90']:.1%}  (no row term: {without['median']:.1%}, {without['p90']:.1%})"))
    if "calibration" in d:
        c = d["calibration"]
        rows.append(("calibration", f"ECE path raw {c['raw_path_ece']:.3f} -> {c['calibrated_path_ece']:.3f}  "
                                    f"per step: raw sum {c['raw_sum_per_step']:.2f}, calibrated {c['calibrated_sum_per_step']:.2f}, "
                                    f"accepted {c['accepted_per_step']:.2f}"))
    if "expert_predictor" in d:
        p = d["expert_predictor"]
        recall = " ".join(f"{v:.2f}" for v in p["node_recall"])
        rows.append(("predictor", f"node recall per layer {recall}  (chance {p['chance_recall']:.2f})"))
    curve = profile.unique_experts_curve
    if curve is not None:
        real = ["-" if np.isnan(v) else f"{v:.1f}" for v in curve.real.mean(axis=1)]
        random = [f"{v:.1f}" for v in curve.random.mean(axis=1)]
        rows.append(("unique experts", f"T={list(curve.sizes)}  trees {real}  random {random}"))
    if "fetch_cost_report" in d:
        f = d["fetch_cost_report"]
        curve = ", ".join(f"{c}:{v:.2f}" for c, v in zip(f["fetch_cost"]["counts"], np.mean(f["fetch_cost"]["ms"], axis=0)))
        rows.append(("fetch cost", f"{f['offload']['offload']}: m(M) ms {curve} (mean over layers)"))
        if "error_refit_with_fetch_term" in f:
            a, b = f["error_refit_with_fetch_term"], f["error_compute_only"]
            rows.append(("fetch error", f"held-out offloaded passes (n={a['n']}): median {a['median']:.1%} p90 {a['p90']:.1%} "
                                        f"(compute only: {b['median']:.1%}, {b['p90']:.1%})"))
    for entry in profile.arm_rates:
        best = max(entry.rates.values())
        ranked = sorted(entry.rates.items(), key=lambda kv: -kv[1])
        where = "resident" if entry.resident_experts is None else f"{entry.resident_experts} experts resident"
        rows.append((f"arms, B={entry.rows}", f"temperature {entry.sampling.temperature:g}, {where}: "
                                              + "  ".join(f"{arm} {rate / best:.2f}" for arm, rate in ranked)))
    if "draft_cost" in d:
        dc = d["draft_cost"]
        rows.append(("draft cost", f"{dc['base_ms']:.3f} ms + {dc['per_depth_ms']:.3f} ms/depth + {dc['per_node_ms']:.4f} ms/node"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)
