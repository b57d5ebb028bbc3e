"""`moe-spec convert-head SRC DST --layout L`: an EAGLE-3 head folder rewritten in another published layout.

The source's layout is detected from its config.json (`moe_spec.drafters.head_layouts`); the weights
keep their dtype unless `--dtype` says otherwise, so a conversion and its way back are exact.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from moe_spec.drafters.head_layouts import LAYOUTS, load_head, save_head
from moe_spec.errors import MoeSpecError

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help="a head folder in any layout moe_spec reads (speculators, specforge, eagle, angelslim)")
    parser.add_argument("destination", help="folder to write (created; an existing head there is overwritten)")
    parser.add_argument("--layout", required=True, choices=LAYOUTS, help="the layout to write")
    parser.add_argument("--dtype", choices=["keep", *DTYPES], default="keep",
                        help="floating weights' dtype in the written file; keep: the source's")


def run(args: argparse.Namespace) -> dict:
    source, destination = Path(args.source), Path(args.destination)
    if source.resolve() == destination.resolve():
        raise MoeSpecError(f"destination {destination} is the source folder; write the converted head elsewhere")
    head = load_head(source, dtype=None)
    dtype = head.dtype if args.dtype == "keep" else DTYPES[args.dtype]
    save_head(head, destination, args.layout, dtype=dtype)
    summary = {"command": "convert-head", "source": str(source), "source_layout": head.layout,
               "destination": str(destination), "layout": args.layout, "dtype": str(dtype).removeprefix("torch."),
               "draft_vocab_size": head.config.draft_vocab, "aux_layers": list(head.config.aux_layers) or None}
    print(json.dumps(summary))
    return summary
