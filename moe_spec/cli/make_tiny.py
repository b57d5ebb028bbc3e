"""`moe-spec make-tiny`: save a tiny random model of a supported architecture, to try the CLI."""

from __future__ import annotations

import argparse
import json

from moe_spec.cli.option_types import seed
from moe_spec.testing.tiny_models import TINY_CONFIGS, tiny_model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arch", default="qwen3_moe", choices=sorted(TINY_CONFIGS))
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=seed, default=0)


def run(args: argparse.Namespace) -> dict:
    model = tiny_model(args.arch, seed=args.seed)
    model.save_pretrained(args.out)
    summary = {"command": "make-tiny", "arch": args.arch, "out": args.out, "params": sum(p.numel() for p in model.parameters())}
    print(json.dumps(summary))
    return summary
