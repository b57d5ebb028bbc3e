"""`moe-spec bench`: decoding methods side by side on a prompt set; a table, a JSON report, a JSON line."""

from __future__ import annotations

import argparse
import hashlib
import json
from collections import Counter
import os
import platform
import shlex
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import torch
import transformers

from moe_spec.cli.json_output import add_json_argument, write_json
from moe_spec.cli.model_options import add_model_arguments, resolve_model_options
from moe_spec.cli.defaults import field_defaults
from moe_spec.cli.offload_options import add_offload_arguments, offload_config, offload_from_args, offload_summary
from moe_spec.cli.option_types import (
    experts_implementation, non_negative_int, positive_int, sampling_label, sampling_setting, seed, temperature,
    top_k, top_p,
)
from moe_spec.policy.registry import STATIC_BEST, MethodContext, build_method, expand_methods, method_names, parse_methods
from moe_spec.experiments.bench_plots import write_bench_plots
from moe_spec.experiments.hf_reference import REFERENCES
from moe_spec.experiments.prompt_file import load_prompts
from moe_spec.experiments.report import build_report, format_report, format_table, summary_line
from moe_spec.experiments.runner import RunSettings, run_methods
from moe_spec.errors import InputError
from moe_spec.profile.artifact import Profile
from moe_spec.measure.store import DEFAULT_PROFILE, cached_profile_path, profile_for
from moe_spec.loading import load_drafter, load_target, load_tokenizer, model_folder
from moe_spec.core.sampling import SamplingConfig
from moe_spec.core.target import TargetModel

RUN_DEFAULTS = field_defaults(RunSettings)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model folder (default: the embedded target)")
    parser.add_argument("--drafter", default="default",
                        help="a drafter: 'lookup', 'mtp' (the checkpoint's own MTP layers), 'default' (the embedded EAGLE-3 head), 'none', or a folder holding an EAGLE-3 head (any published layout) or a causal LM sharing the target's tokenizer (a draft model); shared by every drafting method")
    parser.add_argument("--prompts", required=True, help="JSON-lines prompt file (`prompt` or `prompt_ids`, optional `class`)")
    parser.add_argument("--methods", default="ar,static-best,moe-aware",
                        help=f"comma-separated: {method_names()}; transformers' own loops as references: "
                             f"{', '.join(REFERENCES)}")
    parser.add_argument("--profile", default=None,
                        help="profile JSON for truncate / moe-aware (default: shipped, cached, or profiled now)")
    parser.add_argument("--plots", default=None, help="folder for PNG figures")
    parser.add_argument("--max-new-tokens", type=positive_int, default=RUN_DEFAULTS["max_new_tokens"])
    parser.add_argument("--batch-size", type=positive_int, default=RUN_DEFAULTS["batch_size"],
                        help="prompts of one class decoded together (left-padded)")
    parser.add_argument("--temperature", type=temperature, default=RUN_DEFAULTS["temperature"], help="0: greedy")
    parser.add_argument("--top-k", type=top_k, default=RUN_DEFAULTS["top_k"], help="0: no top-k filter")
    parser.add_argument("--top-p", type=top_p, default=RUN_DEFAULTS["top_p"], help="1: no nucleus filter")
    parser.add_argument("--sampling", type=sampling_setting, nargs="+", default=None, metavar="SETTING",
                        help="several sampling settings, each benched in turn and reported side by side, e.g. "
                             "temperature=1 temperature=0.7,top_p=0.9 (replaces --temperature, --top-k, --top-p)")
    parser.add_argument("--seed", type=seed, default=RUN_DEFAULTS["seed"])
    parser.add_argument("--repeats", type=positive_int, default=RUN_DEFAULTS["repeats"],
                        help="passes over the prompts, methods interleaved; figures are totals (steadier on a busy machine)")
    parser.add_argument("--limit", type=positive_int, default=None,
                        help="at most this many prompts per class (the first ones)")
    parser.add_argument("--warmup-tokens", type=non_negative_int, default=RUN_DEFAULTS["warmup_tokens"],
                        help="per method, before timing; 0: no warm-up")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's own choice)")
    parser.add_argument("--experts-implementation", type=experts_implementation, default="grouped_mm",
                        help="transformers' (grouped_mm, batched_mm, eager) or megablocks where installed")
    add_model_arguments(parser)
    add_json_argument(parser)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--trace", default=None, metavar="OUT",
                        help="also record eagle2's steps (trees, target argmax, routing, times) as JSON lines "
                             "for `moe-spec simulate`; the profile is copied beside it")
    add_offload_arguments(parser)


def run(args: argparse.Namespace) -> dict:
    requested = parse_methods(args.methods, references=REFERENCES)
    names = expand_methods(requested)
    samplings = _samplings(args)
    if args.trace is not None and len(samplings) > 1:
        raise InputError("--trace records one sampling setting; give one --sampling (or --temperature / --top-k / --top-p)")
    base = RunSettings(max_new_tokens=args.max_new_tokens, seed=args.seed, warmup_tokens=args.warmup_tokens,
                       batch_size=args.batch_size, repeats=args.repeats)
    prompts = load_prompts(args.prompts, args.limit)
    offload_config(args)  # a bad offload option is named before the model loads
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    resolve_model_options(args)
    model = load_target(args.model, dtype=args.dtype, experts_implementation=args.experts_implementation,
                        device=args.device, device_map=args.device_map)
    tokenizer = load_tokenizer(args.model)
    input_ids = [p.input_ids(tokenizer) for p in prompts]
    offload = offload_from_args(args, model)
    try:
        return _bench(args, TargetModel(model, offload=offload), prompts, input_ids, requested, names, samplings, base)
    finally:
        if offload is not None:
            offload.close()


def _bench(args: argparse.Namespace, target: TargetModel, prompts, input_ids, requested, names: list[str],
           samplings: list[SamplingConfig], base: RunSettings) -> dict:
    """Every sampling setting in turn; print the table(s) and the JSON line, write the report."""
    context = MethodContext(target, lambda: load_drafter(args.drafter, target),
                            lambda: _profile(args, target, context, input_ids))
    methods = [REFERENCES.get(name) or build_method(name, context) for name in names]
    classes = [p.prompt_class for p in prompts]
    meta = [{**p.meta, "prompt_tokens": int(ids.shape[1])} for p, ids in zip(prompts, input_ids)]

    reports = {}
    for sampling in samplings:  # each setting in turn, every method interleaved within it
        settings = replace(base, temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
        before = _decisions(methods)
        runs = run_methods(target, methods, input_ids, settings, progress=False if args.no_progress else None,
                           classes=classes)
        decisions = _decision_shares(before, _decisions(methods))
        config = _config(args, target.model, names, settings)
        if target.offload is not None:
            config["offload"] = offload_summary(target.offload)
        if context.profile_source is not None:
            config["profile"] = context.profile_source
        report = build_report(runs, names, classes, meta, config, static_best=any(n.partition("@")[0] == STATIC_BEST for n in requested))
        if decisions:
            report["decisions"] = decisions
        if args.trace is not None:
            config["trace"] = _trace(args, context, input_ids, classes, settings, config, runs)
        reports[sampling_label(sampling)] = report

    if len(reports) == 1:
        report = next(iter(reports.values()))
        if args.plots is not None:
            report["config"]["plots"] = [str(p) for p in write_bench_plots(report, Path(args.plots))]
        print(format_report(report))
        if report.get("decisions"):
            print(_format_decisions(report["decisions"]))
        line = {"command": "bench", "json": args.json_out, **summary_line(report)}
    else:
        for label, one in reports.items():
            if args.plots is not None:
                one["config"]["plots"] = [str(p) for p in write_bench_plots(one, Path(args.plots) / label)]
            print(f"=== sampling {label} ===\n{format_report(one)}\n{_format_decisions(one.get('decisions', {}))}\n")
        side_by_side = _side_by_side(reports)
        print(side_by_side)
        report = {"sampling": list(reports), "reports": reports}
        line = {"command": "bench", "json": args.json_out,
                "sampling": {label: summary_line(one) for label, one in reports.items()}}
        if target.offload is not None:
            line["offload"] = offload_summary(target.offload)
    write_json(args.json_out, report)
    print(json.dumps(line))
    return report


def _decisions(methods) -> dict[str, Counter]:
    """Per bounded method (`moe-aware` and its ablations), the steps each arm has decided so far."""
    return {method.name: Counter(method.controller.decisions) for method in methods
            if getattr(getattr(method, "controller", None), "decisions", None) is not None}


def _decision_shares(before: dict[str, Counter], after: dict[str, Counter]) -> dict[str, dict[str, float]]:
    """Each bounded method's share of steps per arm between two `_decisions` (warm-up included)."""
    shares = {}
    for name, counts in after.items():
        steps = counts - before.get(name, Counter())
        total = sum(steps.values())
        if total:
            shares[name] = {arm: round(n / total, 4) for arm, n in steps.most_common()}
    return shares


def _format_decisions(shares: dict[str, dict[str, float]]) -> str:
    """One line per bounded method: which arm decided what share of its steps."""
    lines = [f"steps decided by ({name}): " + ", ".join(f"{arm} {share:.0%}" for arm, share in arms.items())
             for name, arms in shares.items()]
    return "\n".join(lines)


def _samplings(args: argparse.Namespace) -> list[SamplingConfig]:
    """--sampling's settings, else the one of --temperature, --top-k and --top-p."""
    single = SamplingConfig(args.temperature, args.top_k, args.top_p)
    if args.sampling is None:
        return [single]
    if single != SamplingConfig():
        raise InputError("--sampling replaces --temperature, --top-k and --top-p; leave those at their defaults "
                         f"(got {sampling_label(single)})")
    labels = [sampling_label(s) for s in args.sampling]
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        raise InputError(f"--sampling lists {', '.join(repeated)} more than once")
    return list(args.sampling)


def _side_by_side(reports: dict[str, dict]) -> str:
    """One row per method, each sampling setting's speedup and accepted length in adjacent columns."""
    first = next(iter(reports.values()))
    figures = {method: {f"{label}|{key}": reports[label]["methods"][method][key]
                        for label in reports for key in ("speedup_vs_ar", "mean_accept_len")}
               for method in first["methods"]}
    columns = tuple(column for label in reports for column in (
        (f"{label} speedup", f"{label}|speedup_vs_ar", "{:.2f}x"), ("accept", f"{label}|mean_accept_len", "{:.2f}")))
    return format_table(figures, "sampling settings side by side (all prompts)", columns)


def _trace(args: argparse.Namespace, context: MethodContext, input_ids, classes, settings: RunSettings,
           config: dict, runs) -> dict:
    """Record eagle2's steps for `moe-spec simulate` (a separate pass; see `moe_spec.experiments.trace_file`)."""
    from moe_spec.experiments.trace_file import record_bench_trace

    profile = context.profile("--trace")  # simulate's policies need one; profiled now if none is cached
    eagle2 = build_method("eagle2", context)
    timed = {i: r.new_ids_of(i) for r in runs if r.method == "eagle2" for i in r.prompt_indices} or None
    return record_bench_trace(args.trace, context.target, eagle2, input_ids, classes, settings, profile,
                              context.profile_source, dict(config), timed)


def _profile(args: argparse.Namespace, target: TargetModel, context: MethodContext, input_ids):
    """--profile, else the shipped / cached profile for this target and drafter, else profile now."""
    if args.profile is not None:
        profile = Profile.load(args.profile, target)
        context.profile_source = args.profile
        return profile
    drafter = context.drafter("profile")
    embedded = args.model is None and args.drafter == "default"
    drafter_name = args.drafter if args.model is None else f"{model_folder(args.model)}|{args.drafter}"
    if not (embedded and DEFAULT_PROFILE.is_file()):
        cached = cached_profile_path(target, drafter_name)
        if cached.is_file():
            print(f"no --profile: using the cached profile {cached}", file=sys.stderr)
        else:
            print(f"no --profile: profiling this target now (minutes) and caching the profile at {cached}",
                  file=sys.stderr)
    profile, source = profile_for(target, drafter, drafter_name, [ids[0] for ids in input_ids], embedded=embedded)
    context.profile_source = source
    return profile


def _config(args: argparse.Namespace, model, names: list[str], settings: RunSettings) -> dict:
    """Everything needed to rerun the benchmark and to tell two machines apart."""
    prompts = Path(args.prompts)
    return {
        "command": _command_line(args),
        "model": str(model_folder(args.model).resolve()),
        "drafter": args.drafter,
        "methods": names,
        "prompts_file": str(prompts),
        "prompts_sha256": hashlib.sha256(prompts.read_bytes()).hexdigest(),
        "limit_per_class": args.limit,
        "max_new_tokens": settings.max_new_tokens,
        "batch_size": settings.batch_size,
        "temperature": settings.temperature,
        "top_k": settings.top_k,
        "top_p": settings.top_p,
        "seed": settings.seed,
        "warmup_tokens": settings.warmup_tokens,
        "repeats": settings.repeats,
        "dtype": args.dtype,
        "experts_implementation": args.experts_implementation,
        "device": str(model.device),
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "threads": torch.get_num_threads(),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "git_commit": _git_commit(),
        },
        "machine": _machine(),
    }


def _command_line(args: argparse.Namespace) -> str:
    parts = ["moe-spec", "bench"]
    for flag, value in (("--model", args.model), ("--drafter", args.drafter), ("--prompts", args.prompts),
                        ("--methods", args.methods), ("--max-new-tokens", args.max_new_tokens),
                        ("--batch-size", args.batch_size), ("--repeats", args.repeats),
                        ("--temperature", args.temperature), ("--top-k", args.top_k), ("--top-p", args.top_p),
                        ("--seed", args.seed), ("--limit", args.limit),
                        ("--warmup-tokens", args.warmup_tokens), ("--threads", args.threads), ("--dtype", args.dtype),
                        ("--experts-implementation", args.experts_implementation), ("--device", args.device),
                        ("--json", args.json_out),
                        ("--trace", args.trace), ("--offload", args.offload),
                        ("--resident-experts", args.resident_experts), ("--offload-dir", args.offload_dir),
                        ("--offload-cache", args.offload_cache), ("--eviction", args.eviction),
                        ("--offload-workers", args.offload_workers)):
        if value is not None:
            parts += [flag, str(value)]
    if args.prefetch:
        parts.append("--prefetch")
    if args.layer_ahead:
        parts.append("--layer-ahead")
    if args.sampling is not None:
        parts += ["--sampling", *(sampling_label(s) for s in args.sampling)]
    return shlex.join(parts)


def _machine() -> dict:
    cpu = platform.processor() or None
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "cpus_usable": affinity,
        "hostname": platform.node(),
        "executable": sys.executable,
    }


def _git_commit() -> str | None:
    """HEAD of the checkout moe_spec runs from, with "-dirty" when it has local changes; None outside git."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
