"""`moe-spec train-target`: train the embedded default MoE target (see `moe_spec.training.train_target`).

    moe-spec train-target --out runs/default_target --minutes 65 --threads 1

Rerunning the same command resumes from `OUT/checkpoint/`. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from dataclasses import replace

import torch

from moe_spec.cli.defaults import field_defaults
from moe_spec.cli.option_types import positive_float, positive_int, seed
from moe_spec.training.train_target import TINY_SHAPE, TrainSettings, train

DEFAULTS = field_defaults(TrainSettings)
DEFAULT_THREADS = 1  # the embedded target was trained on one thread


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="run folder; the model lands in OUT/model")
    parser.add_argument("--minutes", type=positive_float, default=DEFAULTS["minutes"], help="training time budget")
    parser.add_argument("--seed", type=seed, default=DEFAULTS["seed"])
    parser.add_argument("--threads", type=positive_int, default=DEFAULT_THREADS, help="torch CPU threads")
    parser.add_argument("--tiny", action="store_true", help="a tiny model on a small corpus slice (tests, quick looks)")
    parser.add_argument("--max-steps", type=positive_int, default=DEFAULTS["max_steps"], help="optimizer steps in all")
    parser.add_argument("--stop-after-steps", type=positive_int, default=DEFAULTS["stop_after_steps"],
                        help="stop (resumably) after this many steps of this run")
    parser.add_argument("--checkpoint-every-s", type=positive_float, default=DEFAULTS["checkpoint_every_s"],
                        help="seconds between checkpoints")


def settings_from_args(args: argparse.Namespace) -> TrainSettings:
    settings = TrainSettings(
        out=args.out, minutes=args.minutes, seed=args.seed, max_steps=args.max_steps,
        stop_after_steps=args.stop_after_steps, checkpoint_every_s=args.checkpoint_every_s,
    )
    if args.tiny:
        settings = replace(
            settings, shape=TINY_SHAPE, seq_len=32, batch_size=4, warmup_steps=4, calibration_steps=4,
            log_every=2, eval_every=4, eval_windows=2, final_eval_tokens=1024, corpus_chars=150_000,
        )
    return settings


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    os.environ.setdefault("RAYON_NUM_THREADS", str(args.threads))  # tokenizers' thread pool
    meta = train(settings_from_args(args), command=shlex.join(sys.orig_argv))
    print(json.dumps({"command": "train-target", "out": args.out,
                      **({k: meta[k] for k in ("heldout_fp32", "training_minutes") if k in meta} or meta)}))
    return meta
