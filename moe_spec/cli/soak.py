"""`moe-spec soak`: many generations in one process (mixed lengths, batch sizes, methods,
temperatures), then one up to the model's context; reports RSS, hooks and tokens/s drift
(see `moe_spec.experiments.soak`), a human summary and a final JSON line."""

from __future__ import annotations

import argparse
import json
import shlex

import torch

from moe_spec.cli.json_output import add_json_argument, write_json
from moe_spec.cli.model_options import add_model_arguments, resolve_model_options
from moe_spec.cli.defaults import field_defaults
from moe_spec.cli.offload_options import add_offload_arguments, offload_config, offload_from_args, offload_summary
from moe_spec.core.target import TargetModel
from moe_spec.errors import InputError
from moe_spec.experiments.prompt_file import load_prompts
from moe_spec.experiments.soak import SoakSettings, format_soak, long_generation, run_soak
from moe_spec.loading import load_drafter, load_target, load_tokenizer
from moe_spec.measure.store import DEFAULT_PROFILE
from moe_spec.policy.registry import MethodContext, build_method, method_names, parse_methods, runnable_names
from moe_spec.profile.artifact import Profile

DEFAULTS = field_defaults(SoakSettings)
# every registered policy once (`static` at 8 nodes)
ALL_METHODS = ",".join(runnable_names())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model folder (default: the embedded target)")
    parser.add_argument("--drafter", default="default", help="a drafter: 'lookup', 'mtp' (the checkpoint's own MTP layers), 'default' (the embedded EAGLE-3 head), 'none', or a folder holding an EAGLE-3 head (any published layout) or a causal LM sharing the target's tokenizer (a draft model)")
    parser.add_argument("--profile", default=None,
                        help="profile JSON for truncate / moe-aware (default: the embedded pair's shipped profile)")
    parser.add_argument("--prompts", default="configs/bench/heldout.jsonl",
                        help="JSON-lines prompt file: the pool prompts are cut from")
    parser.add_argument("--methods", default=ALL_METHODS, help=f"comma-separated: {method_names()}")
    parser.add_argument("--generations", type=int, default=DEFAULTS["generations"])
    parser.add_argument("--window", type=int, default=DEFAULTS["window"],
                        help="generations per schedule block; first and last windows are compared")
    parser.add_argument("--new-tokens", default=_range(DEFAULTS["new_tokens"]), help="LOW-HIGH max_new_tokens")
    parser.add_argument("--prompt-tokens", default=_range(DEFAULTS["prompt_tokens"]), help="LOW-HIGH prompt length")
    parser.add_argument("--batch-sizes", default=",".join(map(str, DEFAULTS["batch_sizes"])))
    parser.add_argument("--temperatures", default=",".join(map(str, DEFAULTS["temperatures"])))
    parser.add_argument("--seed", type=int, default=DEFAULTS["seed"])
    parser.add_argument("--long-positions", type=int, default=None,
                        help="positions of the long generation (default: the model's context); 0: none")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    add_model_arguments(parser)
    add_json_argument(parser, "the full result")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_offload_arguments(parser)  # the cache is not cleared between generations: a soak of the cache too


def run(args: argparse.Namespace) -> dict:
    names = parse_methods(args.methods)
    settings = SoakSettings(
        generations=args.generations, new_tokens=_parse_range(args.new_tokens, "--new-tokens"),
        prompt_tokens=_parse_range(args.prompt_tokens, "--prompt-tokens"),
        batch_sizes=tuple(_parse_list(args.batch_sizes, int, "--batch-sizes")),
        temperatures=tuple(_parse_list(args.temperatures, float, "--temperatures")),
        window=args.window, seed=args.seed)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    prompts = load_prompts(args.prompts)

    offload_config(args)  # a bad offload option is named before the model loads
    resolve_model_options(args)
    model = load_target(args.model, dtype=args.dtype, device=args.device, device_map=args.device_map)
    offload = offload_from_args(args, model)
    try:
        return _soak(args, TargetModel(model, offload=offload), settings, prompts, names)
    finally:
        if offload is not None:
            offload.close()


def _soak(args: argparse.Namespace, target: TargetModel, settings: SoakSettings, prompts, names: list[str]) -> dict:
    """The soak itself on `target`; prints the summary and the JSON line, writes --json."""
    tokenizer = load_tokenizer(args.model)
    pool = [p.input_ids(tokenizer)[0] for p in prompts]
    profile = args.profile
    if profile is None and args.model is None and args.drafter == "default" and DEFAULT_PROFILE.is_file():
        profile = DEFAULT_PROFILE
    context = MethodContext(target, lambda: load_drafter(args.drafter, target),
                            (lambda: Profile.load(profile, target)) if profile is not None else None)
    methods = [build_method(name, context) for name in names]
    heads = [m.drafter.head for m in methods if isinstance(getattr(m.drafter, "head", None), torch.nn.Module)]

    result = run_soak(target, methods, pool, settings, extra_modules=heads[:1],
                      progress=False if args.no_progress else None)
    if args.long_positions != 0:
        drafting = next((m for m in methods if m.drafter is not None), methods[0])
        positions = args.long_positions or target.max_positions
        if positions is None or positions <= settings.prompt_tokens[0]:
            raise InputError(f"--long-positions must exceed the shortest prompt ({settings.prompt_tokens[0]})")
        result.long = long_generation(target, drafting, pool[0][: settings.prompt_tokens[0]], positions)

    print(format_soak(result))
    offload = offload_summary(target.offload) if target.offload is not None else None
    body = {"command": _command_line(args), "threads": torch.get_num_threads(), **result.to_json(), "offload": offload}
    write_json(args.json_out, body)
    line = {"command": "soak", "json": args.json_out, "generations": result.generations,
            "rss_start_mib": result.rss_start_bytes / 2 ** 20, "rss_end_mib": result.rss_end_bytes / 2 ** 20,
            "rss_growth": result.rss_growth, "hooks_start": result.hooks_start, "hooks_end": result.hooks_end,
            "first_window_tokens_per_s": result.first_window.tokens_per_s,
            "last_window_tokens_per_s": result.last_window.tokens_per_s,
            "tokens_per_s_drift": result.tokens_per_s_drift, "greedy_mismatches": result.greedy_mismatches,
            "long_positions": result.long["positions"] if result.long else None,
            "long_rss_growth_mib": result.long["rss_growth_during_bytes"] / 2 ** 20 if result.long else None,
            "long_cache_mib": result.long["cache_bytes_at_context"] / 2 ** 20 if result.long else None,
            "offload": offload}
    print(json.dumps(line))
    return body


def _range(pair: tuple[int, int]) -> str:
    return f"{pair[0]}-{pair[1]}"


def _parse_range(text: str, option: str) -> tuple[int, int]:
    low, sep, high = text.partition("-")
    if not sep or not low.strip().isdigit() or not high.strip().isdigit():
        raise InputError(f"{option} must be LOW-HIGH, e.g. 4-24 (got {text!r})")
    return int(low), int(high)


def _parse_list(text: str, kind, option: str) -> list:
    try:
        return [kind(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise InputError(f"{option} must be a comma-separated list, got {text!r}") from None


def _command_line(args: argparse.Namespace) -> str:
    parts = ["moe-spec", "soak"]
    for flag in ("model", "drafter", "profile", "prompts", "methods", "generations", "window", "new_tokens",
                 "prompt_tokens", "batch_sizes", "temperatures", "seed", "long_positions", "threads", "dtype",
                 "json_out", "offload", "resident_experts", "offload_dir", "offload_cache", "eviction",
                 "offload_workers"):
        value = getattr(args, flag)
        if value is not None:
            parts += ["--" + ("json" if flag == "json_out" else flag.replace("_", "-")), str(value)]
    if args.prefetch:
        parts.append("--prefetch")
    if args.layer_ahead:
        parts.append("--layer-ahead")
    return shlex.join(parts)
