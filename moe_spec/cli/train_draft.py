"""`moe-spec train-draft`: train an EAGLE-3 draft head for a target (see `moe_spec.training.train_draft`).

    moe-spec train-draft --target runs/default_target/model --out runs/default_draft --minutes 20
    accelerate launch -m moe_spec.cli.main train-draft --target ... --out ...   # data-parallel

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys

import torch

from moe_spec.cli.defaults import field_defaults
from moe_spec.errors import InputError
from moe_spec.cli.option_types import fraction, non_negative_int, positive_float, positive_int, seed
from moe_spec.training.train_draft import DraftTrainSettings, load_target, text_data, train_draft

DEFAULTS = field_defaults(DraftTrainSettings)
DEFAULT_THREADS = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kind", choices=("eagle3", "mtp", "draft-model"), default="eagle3",
                        help="eagle3: an EAGLE-3 head (speculators layout) into --out; mtp: one MTP layer for the target, "
                             "written with a copy of the target's checkpoint into --out (--out may be the target's folder); "
                             "draft-model: a small dense causal LM of the target's vocabulary (--draft-hidden, --draft-layers)")
    parser.add_argument("--draft-hidden", type=positive_int, default=128, help="--kind draft-model: its hidden size")
    parser.add_argument("--draft-layers", type=positive_int, default=2, help="--kind draft-model: its layers")
    parser.add_argument("--target", required=True, help="folder of the target model (and its tokenizer)")
    parser.add_argument("--out", required=True, help="folder for the draft head (--kind mtp: for the target with its MTP layer)")
    parser.add_argument("--minutes", type=positive_float, default=DEFAULTS["minutes"],
                        help="training time budget (ignored with --steps)")
    parser.add_argument("--steps", type=positive_int, default=DEFAULTS["steps"], help="fixed number of steps (reproducible)")
    parser.add_argument("--seed", type=seed, default=DEFAULTS["seed"])
    parser.add_argument("--draft-vocab", type=positive_int, default=DEFAULTS["draft_vocab"],
                        help="size of the reduced draft vocabulary")
    parser.add_argument("--prompts", nargs="+", default=None, help="text files to train on instead of the corpus")
    parser.add_argument("--threads", type=positive_int, default=DEFAULT_THREADS, help="torch CPU threads")
    parser.add_argument("--batch-size", type=positive_int, default=DEFAULTS["batch_size"])
    parser.add_argument("--prompt-len", type=_prompt_len, default=DEFAULTS["prompt_len"],
                        help="tokens of text (the corpus, or --prompts) each training row starts from")
    parser.add_argument("--continuation-len", type=non_negative_int, default=DEFAULTS["continuation_len"],
                        help="tokens the target generates after each row's text (the text the head drafts at run time)")
    parser.add_argument("--sampled-share", type=fraction, default=DEFAULTS["sampled_share"],
                        help="share of rows the target continues by sampling at temperature 1 (the rest greedily)")
    parser.add_argument("--random-prompt-share", type=fraction, default=DEFAULTS["random_prompt_share"],
                        help="share of rows that start from random tokens (of those the text holds) instead of text")
    parser.add_argument("--repeat-prompt-share", type=fraction, default=DEFAULTS["repeat_prompt_share"],
                        help="share of rows whose text window is followed by its own start, so the target copies it "
                             "(with --random-prompt-share at most 1)")
    parser.add_argument("--ttt-steps", type=positive_int, default=DEFAULTS["ttt_steps"], help="passes of the training-time test")
    parser.add_argument("--head-intermediate", type=non_negative_int, default=DEFAULTS["head_intermediate"],
                        help="the head's MLP width (0: 4 x hidden)")
    parser.add_argument("--head-layers", type=positive_int, default=DEFAULTS["head_layers"],
                        help="decoder layers in the head (default 1, or the --init head's; published EAGLE-3 heads have 1, "
                             "more draft slower and may accept more)")
    parser.add_argument("--init", default=None, metavar="HEAD_FOLDER",
                        help="--kind eagle3: train further from this head (any layout: speculators, EAGLE, SpecForge, "
                             "AngelSlim), keeping its vocabulary and feature layers; e.g. a published head fine-tuned "
                             "on your own text with --prompts")
    parser.add_argument("--lr", type=positive_float, default=DEFAULTS["lr"], help="peak learning rate (cosine schedule)")
    parser.add_argument("--aux-layers", type=_layer_ids, default=None,
                        help="the target hidden states the head fuses, e.g. 2,4,7 (default: EAGLE's 2, N//2, N-3)")


def _prompt_len(text: str) -> int:
    value = positive_int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"expected at least 2 tokens, got {text!r}")
    return value


def _layer_ids(text: str) -> tuple[int, ...]:
    try:
        ids = tuple(sorted(int(v) for v in text.split(",") if v.strip()))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer ids, got {text!r}") from None
    if not ids or min(ids) < 0 or len(set(ids)) != len(ids):
        raise argparse.ArgumentTypeError(f"expected distinct hidden-state indices >= 0, got {text!r}")
    return ids


def settings_from_args(args: argparse.Namespace) -> DraftTrainSettings:
    return DraftTrainSettings(
        out=args.out, minutes=args.minutes, steps=args.steps, seed=args.seed, draft_vocab=args.draft_vocab,
        batch_size=args.batch_size, ttt_steps=args.ttt_steps, head_intermediate=args.head_intermediate,
        head_layers=args.head_layers,
        aux_layers=args.aux_layers, init=args.init, lr=args.lr, prompt_len=args.prompt_len,
        continuation_len=args.continuation_len, sampled_share=args.sampled_share,
        random_prompt_share=args.random_prompt_share,
        repeat_prompt_share=args.repeat_prompt_share,
    )


def run(args: argparse.Namespace) -> dict:
    if args.init is not None and args.kind != "eagle3":
        raise InputError(f"--init trains an EAGLE-3 head further; --kind {args.kind} starts from scratch")
    torch.set_num_threads(args.threads)
    settings = settings_from_args(args)
    target, tokenizer = load_target(args.target)
    data = text_data(tokenizer, args.prompts)
    if args.kind == "mtp":
        from moe_spec.loading import model_folder
        from moe_spec.training.train_mtp import train_mtp

        meta = train_mtp(target, model_folder(args.target), data, settings, command=shlex.join(sys.orig_argv))
        keys = ("minutes", "steps", "heldout_top1_agreement_by_depth")
    elif args.kind == "draft-model":
        from moe_spec.loading import model_folder
        from moe_spec.training.train_draft_model import train_draft_model

        meta = train_draft_model(target, model_folder(args.target), data, settings, hidden=args.draft_hidden,
                                 layers=args.draft_layers, command=shlex.join(sys.orig_argv))
        keys = ("minutes", "steps", "parameters", "heldout_top1_agreement")
    else:
        meta = train_draft(target, data, settings, command=shlex.join(sys.orig_argv))
        keys = ("minutes", "steps", "heldout_token_coverage", "heldout_top1_agreement_by_depth")
    print(json.dumps({"command": "train-draft", "kind": args.kind, "out": args.out, **{k: meta[k] for k in keys}}))
    return meta
