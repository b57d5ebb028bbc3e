"""`moe-spec demo`: the embedded MoE pair, plain decoding against the default method.

A small `moe-spec bench`: a few held-out prompts (one code, one prose, one copy-heavy; the first of
each class in `configs/bench/heldout.jsonl`, rebuilt from the corpus so an installed package
needs no prompt file), `ar` and the default method (`moe-aware` on the pair's shipped profile, see
`moe_spec.cli.default_method`) interleaved, greedy unless `--temperature` (with `--top-k`,
`--top-p`) samples, with a progress bar. Prints the first prompt continued by both, a line of
tokens/s and speedup for each, and a JSON line.
"""

from __future__ import annotations

import argparse
import json

from moe_spec.cli.model_options import add_model_arguments, resolve_model_options
from moe_spec.cli.default_method import default_method, profile_path
from moe_spec.cli.defaults import field_defaults
from moe_spec.cli.offload_options import add_offload_arguments, offload_config, offload_from_args, offload_summary
from moe_spec.cli.option_types import positive_int, sampling_label, seed, temperature, top_k, top_p
from moe_spec.core.sampling import SamplingConfig
from moe_spec.policy.registry import MethodContext, build_method
from moe_spec.experiments.prompt_sets import build_prompt_sets
from moe_spec.experiments.prompt_file import Prompt, load_prompts
from moe_spec.experiments.report import build_report, offload_line
from moe_spec.experiments.runner import RunSettings, run_methods
from moe_spec.errors import InputError
from moe_spec.loading import DEFAULT_DRAFTER, DEFAULT_TARGET, load_drafter, load_target, load_tokenizer
from moe_spec.profile.artifact import Profile
from moe_spec.core.target import TargetModel

RUN_DEFAULTS = field_defaults(RunSettings)
PROMPT_CLASSES = ("code", "prose", "copy")
COLUMNS = (
    ("tok/s", "tokens_per_s", "{:.1f}"),
    ("speedup", "speedup_vs_ar", "{:.2f}x"),
    ("accepted length", "mean_accept_len", "{:.2f}"),
    ("experts/layer per verify", "unique_experts_per_layer", "{:.1f}"),
    ("draft time", "draft_share", "{:.0%}"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model folder (default: the embedded target)")
    parser.add_argument("--drafter", default="default", help="a drafter: 'lookup', 'mtp' (the checkpoint's own MTP layers), 'default' (the embedded EAGLE-3 head), 'none', or a folder holding an EAGLE-3 head (any published layout) or a causal LM sharing the target's tokenizer (a draft model)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=RUN_DEFAULTS["max_new_tokens"])
    parser.add_argument("--temperature", type=temperature, default=RUN_DEFAULTS["temperature"], help="0: greedy")
    parser.add_argument("--top-k", type=top_k, default=RUN_DEFAULTS["top_k"], help="0: no top-k filter")
    parser.add_argument("--top-p", type=top_p, default=RUN_DEFAULTS["top_p"], help="1: no nucleus filter")
    parser.add_argument("--seed", type=seed, default=RUN_DEFAULTS["seed"], help="of the sampling generators")
    parser.add_argument("--prompts", default=None,
                        help="JSON-lines prompt file; the first prompt of each class, three at most "
                             "(default: code, prose and copy prompts built from the held-out corpus)")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's own choice)")
    add_model_arguments(parser)
    add_offload_arguments(parser)


def run(args: argparse.Namespace) -> dict:
    _check_embedded_pair(args)
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    offload_config(args)  # a bad offload option is named before the model loads
    resolve_model_options(args)
    model = load_target(args.model, dtype=args.dtype, device=args.device, device_map=args.device_map)
    offload = offload_from_args(args, model)
    try:
        return _demo(args, TargetModel(model, offload=offload))
    finally:
        if offload is not None:
            offload.close()


def _demo(args: argparse.Namespace, target: TargetModel) -> dict:
    """Plain decoding and the default method on the demo prompts: the first prompt continued by
    both, side by side, then a line each of tokens/s and speedup; the JSON line last."""
    tokenizer = load_tokenizer(args.model)
    prompts = _prompts(args.prompts, tokenizer)
    settings = RunSettings(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                           top_p=args.top_p, seed=args.seed)
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)
    profile = profile_path(args.model, args.drafter, None, target)
    default = default_method("demo", args.model, args.drafter, profile)
    if profile is None and not sampling.greedy:  # no profile to choose sampled candidates by: the top ones
        default += "@top"
    names = ("ar", default)
    context = MethodContext(target, lambda: load_drafter(args.drafter, target),
                            (lambda: Profile.load(profile, target)) if profile is not None else None)
    methods = [build_method(name, context) for name in names]
    input_ids = [p.input_ids(tokenizer) for p in prompts]
    runs = run_methods(target, methods, input_ids, settings, progress=True)
    classes = [p.prompt_class for p in prompts]
    report = build_report(runs, names, classes, [{} for _ in prompts], config={"demo": True})
    offload = offload_summary(target.offload) if target.offload is not None else None

    first = {r.method: r.new_ids_of(0) for r in runs if 0 in r.prompt_indices}
    identical = all(
        len({r.new_ids_of(i) for r in runs if i in r.prompt_indices}) == 1 for i in range(len(prompts))
    )
    print(f"--- the {classes[0]} prompt (its last lines) ---")
    print(_tail(_decode(tokenizer, input_ids[0][0].tolist())))
    for name, title in zip(names, ("plain decoding (ar)", f"{default} (the default method)")):
        print(f"--- continued by {title} ---")
        print(_decode(tokenizer, list(first[name])))
    print("---")
    if offload is not None:
        print(offload_line(offload))
    label = "greedy" if sampling.greedy else "sampled: " + sampling_label(sampling)
    print(f"{len(prompts)} prompts ({', '.join(classes)}), {args.max_new_tokens} new tokens each, {label}:")
    for name in names:
        figures = report["methods"][name]
        print(f"  {name:>16}: {figures['tokens_per_s']:6.1f} tokens/s  {figures['speedup_vs_ar']:.2f}x plain decoding  "
              f"accepted length {figures['mean_accept_len']:.2f}  experts per layer per verify "
              f"{figures['unique_experts_per_layer']:.1f}")
    if sampling.greedy:
        print(f"the same tokens as plain decoding on every prompt: {'yes' if identical else 'NO'}")
    else:  # each method samples the target's distribution, but draws its random numbers differently
        print("sampled: both follow the target's distribution; their draws differ")
    summary = {
        "command": "demo",
        "prompts": classes,
        "sampling": sampling_label(sampling),
        "default_method": default,
        "identical_to_ar": identical if sampling.greedy else None,  # sampled draws differ by method
        "methods": {m: {key: f[key] for _, key, _ in COLUMNS} for m, f in report["methods"].items()},
    }
    if offload is not None:
        summary["offload"] = offload
    print(json.dumps(summary))
    return summary


def _check_embedded_pair(args: argparse.Namespace) -> None:
    missing = []
    if args.model is None and not (DEFAULT_TARGET / "config.json").is_file():
        missing.append(f"target {DEFAULT_TARGET}")
    if args.drafter == "default" and not (DEFAULT_DRAFTER / "config.json").is_file():
        missing.append(f"draft head {DEFAULT_DRAFTER}")
    if missing:
        raise InputError(
            "the embedded pair is not in this install (missing " + " and ".join(missing) + "); train it with "
            "`moe-spec train-target` and `moe-spec train-draft`, or pass --model and --drafter"
        )


def _prompts(path: str | None, tokenizer) -> list[Prompt]:
    if path is not None:
        return load_prompts(path, limit_per_class=1)[: len(PROMPT_CLASSES)]
    if tokenizer is None:
        raise InputError("the model folder has no tokenizer to build the demo prompts with; pass --prompts "
                         "(a JSON-lines file with `prompt_ids`)")
    return build_prompt_sets(tokenizer, per_class=1, seed=0, classes=PROMPT_CLASSES)


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids) if tokenizer is not None else " ".join(map(str, ids))


def _tail(text: str, lines: int = 6) -> str:
    return "".join(text.splitlines(keepends=True)[-lines:])
