"""Plain decoding with experts offloaded: moe_spec's resident cache against the ways people offload today.

    python scripts/offload_peers.py --prompts configs/bench/heldout.jsonl --limit 2 \
        --resident 8 16 32 --json analysis/results/offload/peers_shipped.json

Peers (see `moe_spec/experiments/offload_peers.py`): everything resident, the resident cache at each
C, no cache, whole-layer fetching, accelerate's disk offload. Greedy, the embedded target, one
torch thread, interleaved prompt by prompt. Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tqdm import tqdm

from moe_spec.experiments.offload_peers import run_peers
from moe_spec.experiments.prompt_file import load_prompts
from moe_spec.loading import load_target, load_tokenizer


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder (default: the embedded target)")
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--limit", type=int, default=None, help="prompts per class")
    parser.add_argument("--resident", type=int, nargs="+", default=[16], help="cache sizes C to run")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--store", default=None, help="expert store folder (default runs/expert_store/<model>-float32)")
    parser.add_argument("--no-accelerate", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(args.model)
    prompts = [p.input_ids(tokenizer) for p in load_prompts(args.prompts, args.limit)]
    store = args.store or f"runs/expert_store/{Path(args.model or 'default_target').name}-float32"
    runs = run_peers(lambda: load_target(args.model), prompts, store, tuple(args.resident), args.max_new_tokens,
                     args.repeats, accelerate=not args.no_accelerate, progress=lambda work: tqdm(work, desc="peers"))
    rows = [run.summary(runs[0]) for run in runs]
    print(f"{'peer':<16} {'tok/s':>8} {'vs resident':>12} {'miss/tok':>9} {'MB/tok':>8} {'resident MB':>12}  identical")
    for row in rows:
        print(f"{row['peer']:<16} {row['tokens_per_s']:>8.2f} {row['vs_resident']:>12.3f} {row['misses_per_token']:>9.2f} "
              f"{row['mb_read_per_token']:>8.3f} {row['resident_mb'] or 0:>12.1f}  {row['identical_to_resident']}"
              + (f"  ({row['note']})" if row["note"] else ""))
    by_name = {row["peer"]: row for row in rows}
    line = {"command": "offload_peers", "prompts": args.prompts, "limit": args.limit, "peers": rows}
    if "cache:16" in by_name and "whole-layer" in by_name:
        line["cache16_vs_whole_layer"] = round(by_name["cache:16"]["tokens_per_s"] / by_name["whole-layer"]["tokens_per_s"], 3)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(line, indent=2))
    print(json.dumps(line))
    return line


if __name__ == "__main__":
    main()
