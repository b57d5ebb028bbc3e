"""What a plain step costs when `moe-aware`'s bound decides it, against `ar`'s: the same prompts
decoded by `ar` and by the bound held to its plain arm, in turns, each part of a step timed from
the engine's own record (`StepRecord`: verify, the head's commit and the acceptance, the plan) and
the gap until the next step begins (the controller's `observe` and the loop's bookkeeping).

    python scripts/plain_step_overhead.py --prompts configs/bench/foreign_heldout.jsonl --limit 8 --temperature 1 [--resident-experts 16]

The bound holds the drafter, so its plain passes also return the head's features and commit the
accepted token to the head; `ar` decodes without a drafter. Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from moe_spec.core.engine import SpecDecoder
from moe_spec.core.step_record import DecodeObserver, StepRecord
from moe_spec.core.target import TargetModel
from moe_spec.experiments.prompt_file import in_class_turns, load_prompts
from moe_spec.experiments.runner import prompt_generator
from moe_spec.loading import load_drafter, load_target, load_tokenizer
from moe_spec.offload.offloaded_experts import OffloadConfig, offload_experts
from moe_spec.policy.bounded_controller import PLAIN, BoundedController
from moe_spec.policy.budget_bandit import BudgetBandit
from moe_spec.policy.registry import build_controller
from moe_spec.profile.artifact import Profile

PARTS = ("verify_ms", "accept_ms", "plan_ms", "draft_ms", "gap_ms")
WAYS = ("ar", "bound, plain")


class _Steps(DecodeObserver):
    """The step records of one request."""

    def __init__(self):
        self.records: list[StepRecord] = []

    def on_step(self, record: StepRecord) -> None:
        self.records.append(record)


def step_parts(records: list[StepRecord]) -> list[dict[str, float]]:
    """Each step's parts in ms; the gap (from the end of the step to the next one's start) where a
    next step tells it."""
    parts = [{name: getattr(r, name) for name in PARTS[:-1]} for r in records]
    for part, record, after in zip(parts, records, records[1:]):
        if record.started is not None and after.started is not None:
            part["gap_ms"] = (after.started - record.started) * 1000 - record.step_ms
    return parts


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=Path, required=True)
    parser.add_argument("--limit", type=int, default=8, help="prompts, the classes taking turns")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--resident-experts", type=int, default=None, help="offload the experts behind a cache of this many")
    parser.add_argument("--profile", default=None,
                        help="default: the shipped profile resident, analysis/results/offload/profile_disk.json offloaded")
    parser.add_argument("--offload-dir", default="runs/expert_store/default_target-float32")
    args = parser.parse_args(argv)
    for name in ("limit", "max_new_tokens", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    model = load_target(None)
    tokenizer = load_tokenizer(None)
    prompts = [p.input_ids(tokenizer) for p in in_class_turns(load_prompts(args.prompts))][: args.limit]  # each [1, T]
    offload = (offload_experts(model, OffloadConfig(args.offload_dir, resident=args.resident_experts))
               if args.resident_experts is not None else None)
    profile_path = args.profile or ("analysis/results/offload/profile_disk.json" if offload is not None
                                    else "moe_spec/assets/default_profile.json")
    parts: dict[str, list[dict[str, float]]] = {way: [] for way in WAYS}
    try:
        target = TargetModel(model, offload=offload)
        drafter = load_drafter("default", target)
        profile = Profile.load(profile_path, target)
        bounded = build_controller("moe-aware", lambda: profile, residency=offload.residency if offload else None)
        decoders = {"ar": SpecDecoder(target),
                    "bound, plain": SpecDecoder(target, drafter, BoundedController(bounded.sizing,
                                                                                   bandit=BudgetBandit((PLAIN,))))}
        with tqdm(total=args.repeats * len(prompts) * len(WAYS), desc="plain steps", file=sys.stderr) as bar:
            for repeat in range(args.repeats):
                for index, input_ids in enumerate(prompts):
                    for way in WAYS[(index + repeat) % 2:] + WAYS[: (index + repeat) % 2]:
                        if offload is not None:
                            offload.clear()
                        steps = decoders[way].observer = _Steps()
                        decoders[way].generate(input_ids, torch.ones_like(input_ids), max_new_tokens=args.max_new_tokens,
                                               temperature=args.temperature, eos_token_id=[],
                                               generator=prompt_generator(0, index, repeat))
                        parts[way] += step_parts(steps.records)[1:]  # the first step follows the prefill
                        bar.update(1)
    finally:
        if offload is not None:
            offload.close()
    means = {way: {name: statistics.mean(p[name] for p in steps if name in p) for name in PARTS}
             for way, steps in parts.items()}
    totals = {way: sum(m.values()) for way, m in means.items()}
    print(f"a plain step's parts, mean ms ({args.prompts}, {len(prompts)} prompts x {args.repeats}, "
          f"T = {args.temperature:g}, {'C = ' + str(args.resident_experts) if offload else 'resident'})")
    print(f"{'way':<14} " + " ".join(f"{name[:-3]:>8}" for name in PARTS) + f" {'total':>8}")
    for way in WAYS:
        print(f"{way:<14} " + " ".join(f"{means[way][name]:8.3f}" for name in PARTS) + f" {totals[way]:8.3f}")
    ratio = totals["bound, plain"] / totals["ar"]
    print(f"the bound's plain step / ar's: {ratio:.3f}")
    report = {"command": "plain_step_overhead", "prompts": str(args.prompts), "temperature": args.temperature,
              "resident_experts": args.resident_experts, "steps": {way: len(p) for way, p in parts.items()},
              "mean_ms": means, "total_ms": totals, "bound_over_ar": round(ratio, 4)}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
