"""`moe-spec generate`: decode one prompt and summarise what speculation did."""

from __future__ import annotations

import argparse
import json

import torch

from moe_spec.core.engine import SpecDecoder
from moe_spec.errors import InputError
from moe_spec.loading import load_drafter, load_target, load_tokenizer
from moe_spec.core.target import TargetModel


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model folder (default: the embedded target)")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (needs a tokenizer beside the model)")
    prompt.add_argument("--prompt-ids", help="prompt as space-separated token ids")
    parser.add_argument("--drafter", default="default", help="'none', 'lookup', 'default' (embedded head) or a head folder")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--experts-implementation", default="grouped_mm")
    parser.add_argument("--json", action="store_true", help="end with one JSON line")


def run(args: argparse.Namespace) -> dict:
    model = load_target(args.model, dtype=args.dtype, experts_implementation=args.experts_implementation)
    tokenizer = load_tokenizer(args.model)
    if args.prompt is not None:
        if tokenizer is None:
            raise InputError(f"the model folder {args.model} has no tokenizer; pass --prompt-ids")
        input_ids = tokenizer(args.prompt, return_tensors="pt").input_ids
    else:
        input_ids = torch.tensor([[int(t) for t in args.prompt_ids.split()]])
    target = TargetModel(model)
    drafter_spec = args.drafter
    decoder = SpecDecoder(target, drafter=load_drafter(drafter_spec, target))
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
    print(text)
    print(
        f"[{stats.new_tokens} tokens, {stats.tokens_per_s:.1f} tok/s, mean accepted length "
        f"{stats.mean_accept_len:.2f}, unique experts per layer per verify {stats.unique_experts_per_layer:.1f}, "
        f"drafter {drafter_spec}]"
    )
    summary = {"command": "generate", "drafter": drafter_spec, "new_ids": new_ids.tolist(), **stats.summary()}
    if args.json:
        print(json.dumps(summary))
    return summary
