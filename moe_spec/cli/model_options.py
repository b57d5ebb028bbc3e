"""`--device`, `--dtype` and `--device-map`, shared by every command that loads a model.

    moe-spec generate --model ./Qwen3-30B-A3B --device cuda --dtype auto
    moe-spec bench --model ./Mixtral-8x7B --device-map auto      # spread over every GPU (accelerate)

`auto` is the default of both: the device is CUDA when torch sees one, else the CPU; the dtype is
the checkpoint's own on a GPU (a 47B model in float32 would not fit) and float32 on the CPU, where
it is exact (token-identical to transformers' float32 decoding) and, at the embedded target's
shapes, faster than bfloat16. `resolve_model_options` replaces the `auto`s by what they stand for
before a command loads anything, so reports name the device and dtype that ran.
"""

from __future__ import annotations

import argparse
import json

import torch

from moe_spec.cli.option_types import device
from moe_spec.errors import InputError
from moe_spec.loading import DTYPES, model_folder

AUTO = "auto"


def _device_or_auto(text: str) -> str:
    return text if text == AUTO else device(text)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", type=_device_or_auto, default=AUTO,
                        help="where the target and the draft head run: cpu, cuda, cuda:N, mps; "
                             "auto: cuda when available, else cpu")
    parser.add_argument("--dtype", default=AUTO, choices=(AUTO, *sorted(DTYPES)),
                        help="auto: the checkpoint's dtype on a GPU, float32 on the CPU")
    parser.add_argument("--device-map", default=None, choices=(AUTO,),
                        help="auto: accelerate places a model larger than one device over every GPU (then the "
                             "CPU); replaces --device for the target (default: the whole model on --device)")


def resolve_model_options(args: argparse.Namespace) -> None:
    """Replace `--device auto` and `--dtype auto` on `args` by the device and dtype they stand for."""
    if args.device == AUTO:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.dtype == AUTO:
        args.dtype = "float32" if torch.device(args.device).type == "cpu" and args.device_map is None \
            else checkpoint_dtype(getattr(args, "model", None))


def checkpoint_dtype(model: str | None) -> str:
    """The dtype a model folder's config.json was saved in (float32 where it names none or another)."""
    folder = model_folder(model)
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        raise InputError(f"{folder} has no readable config.json") from None
    saved = config.get("dtype") or config.get("torch_dtype")
    return saved if saved in DTYPES else "float32"
