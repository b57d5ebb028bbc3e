"""`moe-spec make-random`: save a randomly initialised MoE with a real model's shapes, to profile
a device's verify cost for that model without its checkpoint (see `moe_spec.testing.random_models`)."""

from __future__ import annotations

import argparse
import json
import time

from moe_spec.cli.option_types import device, positive_int, seed
from moe_spec.errors import InputError
from moe_spec.loading import DTYPES
from moe_spec.testing.random_models import SHAPES, random_model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", required=True, choices=SHAPES)
    parser.add_argument("--out", required=True)
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--device", type=device, default="cpu", help="where the weights are initialised (e.g. cuda: seconds for 7B)")
    parser.add_argument("--seed", type=seed, default=0)
    parser.add_argument("--layers", type=positive_int, default=None,
                        help="keep only the first N decoder layers (each keeps the real model's shapes and cost; "
                             "default: all)")


def run(args: argparse.Namespace) -> dict:
    start = time.perf_counter()
    try:
        model = random_model(args.shape, DTYPES[args.dtype], args.device, args.seed, args.layers)
    except ValueError as error:
        raise InputError(f"--layers: {error}") from None
    model.save_pretrained(args.out)
    summary = {"command": "make-random", "shape": args.shape, "layers": model.config.num_hidden_layers, "out": args.out,
               "dtype": args.dtype,
               "params": sum(p.numel() for p in model.parameters()), "seconds": round(time.perf_counter() - start, 2)}
    print(json.dumps(summary))
    return summary
