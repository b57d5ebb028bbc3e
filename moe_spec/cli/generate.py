"""`moe-spec generate`: decode one prompt and summarise what speculation did.

Without `--method` it decodes with the best method this target and machine allow: `moe-aware`
where a profile of them exists (`--profile`, the embedded pair's shipped one, or the one `moe-spec
profile` cached for this target and drafter), else `FALLBACK_METHOD`, the best fixed tree measured
so far, with a hint on stderr on how to profile (`--drafter none`: plain autoregressive decoding).
`--method NAME` decodes with any method of `moe_spec.policy.registry` on `--drafter`.
"""

from __future__ import annotations

import argparse

import torch

from moe_spec.cli.default_method import FALLBACK_METHOD, default_method, profile_path
from moe_spec.cli.defaults import field_defaults
from moe_spec.cli.json_output import add_json_argument, write_json
from moe_spec.cli.model_options import add_model_arguments, resolve_model_options
from moe_spec.cli.offload_options import add_offload_arguments, offload_config, offload_from_args, offload_summary
from moe_spec.cli.option_types import experts_implementation, positive_int, seed, temperature, top_k, top_p
from moe_spec.core.engine import SpecDecoder
from moe_spec.core.target import TargetModel
from moe_spec.errors import InputError
from moe_spec.experiments.report import offload_line
from moe_spec.experiments.runner import RunSettings
from moe_spec.loading import load_drafter, load_target, load_tokenizer
from moe_spec.policy.registry import Method, MethodContext, build_method, check_runnable, method_names
from moe_spec.profile.artifact import Profile

RUN_DEFAULTS = field_defaults(RunSettings)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model folder (default: the embedded target)")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (needs a tokenizer beside the model)")
    prompt.add_argument("--prompt-ids", help="prompt as space-separated token ids")
    parser.add_argument("--drafter", default="default", help="a drafter: 'lookup', 'mtp' (the checkpoint's own MTP layers), 'default' (the embedded EAGLE-3 head), 'none', or a folder holding an EAGLE-3 head (any published layout) or a causal LM sharing the target's tokenizer (a draft model)")
    parser.add_argument("--method", default=None,
                        help=f"a decoding method: {method_names()} (static-best is a bench aggregate, refused); "
                             f"default: moe-aware where a profile of this target exists, else {FALLBACK_METHOD}")
    parser.add_argument("--profile", default=None,
                        help="profile JSON for truncate / moe-aware (default: the embedded pair's shipped profile)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=RUN_DEFAULTS["max_new_tokens"])
    parser.add_argument("--temperature", type=temperature, default=RUN_DEFAULTS["temperature"], help="0: greedy")
    parser.add_argument("--top-k", type=top_k, default=RUN_DEFAULTS["top_k"], help="0: no top-k filter")
    parser.add_argument("--top-p", type=top_p, default=RUN_DEFAULTS["top_p"], help="1: no nucleus filter")
    parser.add_argument("--seed", type=seed, default=RUN_DEFAULTS["seed"])
    parser.add_argument("--experts-implementation", type=experts_implementation, default="grouped_mm")
    add_json_argument(parser, "the summary")
    add_model_arguments(parser)
    add_offload_arguments(parser)


def run(args: argparse.Namespace) -> dict:
    if args.method is not None:
        check_runnable(args.method)  # before loading anything
    if args.prompt is not None and not args.prompt:
        raise InputError("--prompt is empty; give some text (or --prompt-ids)")
    prompt_ids = _prompt_ids(args.prompt_ids) if args.prompt_ids is not None else None
    offload_config(args)  # a bad offload option is named before the model loads
    resolve_model_options(args)
    model = load_target(args.model, dtype=args.dtype, experts_implementation=args.experts_implementation,
                        device=args.device, device_map=args.device_map)
    tokenizer = load_tokenizer(args.model)
    offload = offload_from_args(args, model)
    try:
        return _decode(args, TargetModel(model, offload=offload), tokenizer, prompt_ids)
    finally:
        if offload is not None:
            offload.close()


def _decode(args: argparse.Namespace, target: TargetModel, tokenizer, prompt_ids: list[int] | None) -> dict:
    """Decode the prompt, print the continuation and the summary line(s); the JSON summary."""
    input_ids = _input_ids(args, target, tokenizer, prompt_ids)  # [1, T]
    method = _method(args, target)
    decoder = SpecDecoder(target, drafter=method.drafter, controller=method.controller)
    result = decoder.generate(
        input_ids,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        generator=torch.Generator().manual_seed(args.seed),
    )
    new_ids = result.sequences[0, input_ids.shape[1]:]
    text = tokenizer.decode(new_ids) if tokenizer is not None else " ".join(map(str, new_ids.tolist()))
    stats = result.stats
    offload = offload_summary(target.offload) if target.offload is not None else None
    print(text)
    if offload is not None:
        print(offload_line(offload))
    print(
        f"[{method.name}, drafter {args.drafter}: {stats.new_tokens} tokens in {len(stats.steps)} steps, "
        f"{stats.tokens_per_s:.1f} tok/s, mean accepted length {stats.mean_accept_len:.2f}, "
        f"mean verified tree {stats.mean_tree_size:.1f} nodes, unique experts per layer per verify "
        f"{stats.unique_experts_per_layer:.1f}, verify {stats.verify_ms:.1f} ms, draft {stats.draft_ms:.1f} ms"
        f"{_reads(stats) if offload is not None else ''}]"
    )
    summary = {"command": "generate", "method": method.name, "drafter": args.drafter, "device": args.device,
               "dtype": args.dtype, "new_ids": new_ids.tolist(),
               **stats.summary(), "offload": offload}
    write_json(args.json_out, summary)
    return summary


def _input_ids(args: argparse.Namespace, target: TargetModel, tokenizer, prompt_ids: list[int] | None) -> torch.Tensor:
    """[1, T] the prompt: --prompt through the tokenizer, or --prompt-ids checked against the vocabulary."""
    if args.prompt is not None:
        if tokenizer is None:
            raise InputError(f"the model folder {args.model} has no tokenizer; pass --prompt-ids")
        input_ids = tokenizer(args.prompt, return_tensors="pt").input_ids
        if input_ids.shape[1] == 0:
            raise InputError(f"--prompt {args.prompt!r} tokenizes to nothing; give some text")
        return input_ids
    outside = sorted({t for t in prompt_ids if t >= target.vocab_size})
    if outside:
        raise InputError(f"--prompt-ids has token ids outside the model's vocabulary [0, {target.vocab_size}): "
                         f"{outside[:8]}")
    return torch.tensor([prompt_ids])


def _reads(stats) -> str:
    """The offloaded experts' reads of a generation (decode steps; the prefill's are not counted)."""
    hit_rate = stats.hit_rate
    return (f", experts read per token {stats.misses_per_token:.2f}, {stats.bytes_read_per_token / 2**20:.3f} MB "
            f"read per token, hit rate {'-' if hit_rate != hit_rate else f'{hit_rate:.1%}'}")


def _prompt_ids(text: str) -> list[int]:
    """--prompt-ids: token ids separated by spaces (or commas), each an integer >= 0."""
    parts = text.replace(",", " ").split()
    if not parts:
        raise InputError("--prompt-ids is empty; give at least one token id")
    try:
        ids = [int(t) for t in parts]
    except ValueError:
        raise InputError(f"--prompt-ids must be integer token ids separated by spaces, got {text!r}") from None
    if min(ids) < 0:
        raise InputError(f"--prompt-ids must be token ids >= 0, got {min(ids)}")
    return ids


def _method(args: argparse.Namespace, target: TargetModel) -> Method:
    """--method from the registry; without it the best method this target and machine allow
    (`moe_spec.cli.default_method`)."""
    profile = profile_path(args.model, args.drafter, args.profile, target)
    name = args.method or default_method("generate", args.model, args.drafter, profile)
    context = MethodContext(target, lambda: load_drafter(args.drafter, target),
                            (lambda: Profile.load(profile, target)) if profile is not None else None)
    return build_method(name, context)
