"""Reading experts ahead against reading them on demand, offloaded, side by side in one process:
every request is decoded by each of `moe-aware`'s arms under each reading mode, the modes and arms
taking turns request by request (so a slow spell of the machine falls on all), each request from a
cold cache.

Modes: `on-demand` (a layer reads its misses when it reaches them), `prefetch` (the plan's predicted
experts read before the pass, `OffloadConfig.prefetch`), `layer-ahead` (while a layer computes, the
experts the next layer's router picks for its hidden states, `OffloadConfig.layer_ahead`).

    python scripts/offload_ahead_ab.py --prompts configs/bench/heldout.jsonl --limit 8 \\
        --json analysis/results/offload/ahead_ab_shipped.json

Per arm and mode: ms a step and exposed read ms a step (what the pass waited on reads, the reads
ahead's included) over the steps after each request's first four (as the bandit and the profile's
arm stage count them), tokens a step, experts read per token, the share of the experts read ahead
that their pass used, and the rate (tokens per ms) against the same arm on demand, over those steps
and over whole requests (prefill included). Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from tqdm import tqdm

from moe_spec.cli.profile import read_prompts
from moe_spec.core.engine import SpecDecoder
from moe_spec.core.sampling import GREEDY
from moe_spec.core.step_record import DecodeObserver
from moe_spec.core.target import TargetModel
from moe_spec.loading import load_drafter, load_target, load_tokenizer
from moe_spec.offload.offloaded_experts import OffloadConfig, offload_experts
from moe_spec.policy.bounded_controller import SETTLE_STEPS, BoundedController, charged_ms
from moe_spec.policy.budget_bandit import BudgetBandit
from moe_spec.policy.registry import build_controller
from moe_spec.profile.artifact import Profile

MODES = {"on-demand": {}, "prefetch": {"prefetch": True}, "layer-ahead": {"layer_ahead": True}}


class _Steps(DecodeObserver):
    """(tokens, started s, own ms, exposed read ms) per step."""

    def __init__(self):
        self.steps: list[tuple[float, float, float, float]] = []

    def on_step(self, record) -> None:
        wait = record.fetch.wait_ms if record.fetch is not None else 0.0
        self.steps.append((float(record.tokens_produced), record.started, record.step_ms, wait))

    def settled(self) -> list[tuple[float, float, float]]:
        """(tokens, ms until the next step's start, exposed read ms) of the steps after the first few."""
        starts = [step[1] for step in self.steps[1:]] + [None]
        return [(tokens, charged_ms(started, ms, following), wait)
                for (tokens, started, ms, wait), following in zip(self.steps, starts)][SETTLE_STEPS:]


def decode_one(target: TargetModel, drafter, controller, ids: torch.Tensor, max_new_tokens: int, total: dict) -> None:
    """Decode one request ([T] ids) from a cold cache, adding what it read, waited for and made to `total`."""
    offload = target.offload
    offload.clear()
    before = offload.counters.copy()
    steps = _Steps()
    started = time.perf_counter()
    result = SpecDecoder(target, drafter, controller, observer=steps).generate(
        ids[None], max_new_tokens=max_new_tokens, eos_token_id=[])
    total["wall_ms"] += (time.perf_counter() - started) * 1000
    total["new_tokens"] += result.stats.new_tokens
    read = offload.counters.since(before)
    total["misses"] += read.misses
    total["read_ahead"] += read.read_ahead
    total["read_ahead_used"] += read.read_ahead_used
    for tokens, ms, wait in steps.settled():
        total["tokens"] += tokens
        total["ms"] += ms
        total["wait_ms"] += wait
        total["steps"] += 1


def figures(t: dict, ref: dict) -> dict:
    """One arm and mode's figures from its totals `t`, rates against the same arm's on demand `ref`."""
    return {"ms_per_step": t["ms"] / t["steps"], "wait_ms_per_step": t["wait_ms"] / t["steps"],
            "tokens_per_step": t["tokens"] / t["steps"], "misses_per_token": t["misses"] / t["new_tokens"],
            "read_ahead_used": t["read_ahead_used"] / t["read_ahead"] if t["read_ahead"] else None,
            "step_rate_ratio": (t["tokens"] / t["ms"]) / (ref["tokens"] / ref["ms"]),
            "request_rate_ratio": (t["new_tokens"] / t["wall_ms"]) / (ref["new_tokens"] / ref["wall_ms"])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=Path, default=Path("configs/bench/heldout.jsonl"))
    parser.add_argument("--limit", type=int, default=8, help="prompts decoded")
    parser.add_argument("--arms", default="plain,static:1,static:4,sized")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--resident-experts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--profile", type=Path, default=Path("analysis/results/offload/profile_disk.json"))
    parser.add_argument("--offload-dir", default="runs/expert_store/default_target-float32")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    arms, modes = args.arms.split(","), args.modes.split(",")
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown:
        parser.error(f"--modes: unknown {unknown}; known: {list(MODES)}")
    model = load_target(None)
    resident = TargetModel(model)
    profile = Profile.load(args.profile, resident)
    prompts = read_prompts(args.prompts, load_tokenizer(None), resident.vocab_size)[: args.limit]
    # layer-ahead's routers are found once; each mode is a config of the same installed offload
    base = OffloadConfig(args.offload_dir, resident=args.resident_experts, layer_ahead=True)
    offload = offload_experts(model, base)
    target = TargetModel(model, offload=offload)
    drafter = load_drafter("default", target)
    bounded = build_controller("moe-aware", lambda: profile, residency=offload.residency)
    bounded.begin(drafter.default_budget, GREEDY)
    totals = defaultdict(lambda: defaultdict(float))
    runs = [(arm, mode) for arm in arms for mode in modes]
    try:
        with tqdm(total=len(prompts) * len(runs), desc="requests", file=sys.stderr) as bar:
            for index, ids in enumerate(prompts):
                turn = index % len(runs)
                for arm, mode in runs[turn:] + runs[:turn]:
                    offload.config = dataclasses.replace(base, **{"prefetch": False, "layer_ahead": False, **MODES[mode]})
                    controller = BoundedController(bounded.sizing, bandit=BudgetBandit((arm,)))
                    decode_one(target, drafter, controller, ids, args.max_new_tokens, totals[arm, mode])
                    bar.update(1)
    finally:
        offload.close()
    report = {}
    print("| arm | mode | ms / step | exposed read ms / step | tokens / step | experts read / token | "
          "read ahead used | rate x on demand (steps) | rate x on demand (requests) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for arm in arms:
        for mode in modes:
            t, ref = totals[arm, mode], totals[arm, modes[0]]
            if not t["steps"] or not ref["steps"]:
                parser.error(f"{arm} decoded no step after each request's first {SETTLE_STEPS}: "
                             "raise --max-new-tokens")
            row = figures(t, ref)
            report[f"{arm}/{mode}"] = {k: (round(v, 4) if v is not None else None) for k, v in row.items()}
            used = f"{row['read_ahead_used']:.0%}" if row["read_ahead_used"] is not None else "-"
            print(f"| {arm} | {mode} | {row['ms_per_step']:.1f} | {row['wait_ms_per_step']:.2f} | "
                  f"{row['tokens_per_step']:.2f} | {row['misses_per_token']:.1f} | {used} | "
                  f"{row['step_rate_ratio']:.3f} | {row['request_rate_ratio']:.3f} |")
    out = {"prompts": str(args.prompts), "limit": len(prompts), "resident_experts": args.resident_experts,
           "threads": torch.get_num_threads(), "results": report}
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
