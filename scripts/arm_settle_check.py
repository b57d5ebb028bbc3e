"""What the profile's arm stage leaves out when it skips each request's first steps: every arm of
`moe-aware`'s bound decoding the same prompts offloaded, each request from a cold cache as a bench
runs it, its rate counted three ways from the same steps: after the first `SETTLE_STEPS` (as the
arm stage and the bound judge an arm), over every step, and over the whole request with its prefill
(as a bench times it).

    python scripts/arm_settle_check.py --prompts configs/bench/heldout.jsonl --limit 8 --resident-experts 16

The arms take turns request by request, in an order that rotates. Prints a table and, last, one
JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from moe_spec.core.engine import SpecDecoder
from moe_spec.core.target import TargetModel
from moe_spec.experiments.prompt_file import in_class_turns, load_prompts
from moe_spec.loading import load_drafter, load_target, load_tokenizer
from moe_spec.measure.arm_rates_stage import StepCounter
from moe_spec.offload.offloaded_experts import OffloadConfig, offload_experts
from moe_spec.policy.bounded_controller import FIXED_ARMS, PLAIN, SETTLE_STEPS, SIZED, BoundedController
from moe_spec.policy.budget_bandit import BudgetBandit
from moe_spec.policy.registry import build_controller
from moe_spec.profile.artifact import Profile

ARMS = ("plain", "static:1", "static:2", "static:3", "static:4", "sized")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=Path, required=True)
    parser.add_argument("--limit", type=int, default=8, help="prompts, the classes taking turns")
    parser.add_argument("--profile", default="analysis/results/offload/profile_disk.json")
    parser.add_argument("--resident-experts", type=int, default=16)
    parser.add_argument("--offload-dir", default="runs/expert_store/default_target-float32")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated arms of the bound")
    args = parser.parse_args(argv)
    arms = tuple(args.arms.split(","))
    known = (SIZED, PLAIN, *(f"{shape}:{n}" for shape in ("static", "chain") for n in FIXED_ARMS))
    unknown = [arm for arm in arms if arm not in known]
    if unknown or not arms:
        raise SystemExit(f"arm_settle_check.py: --arms: unknown arm(s) {', '.join(unknown)}; the bound's arms are "
                         f"{', '.join(known)}")
    if args.max_new_tokens <= SETTLE_STEPS:
        raise SystemExit(f"arm_settle_check.py: --max-new-tokens must exceed the {SETTLE_STEPS} settling steps")
    model = load_target(None)
    tokenizer = load_tokenizer(None)
    prompts = [p.input_ids(tokenizer) for p in in_class_turns(load_prompts(args.prompts))][: args.limit]  # each [1, T]
    offload = offload_experts(model, OffloadConfig(args.offload_dir, resident=args.resident_experts))
    totals = {arm: {"settled": [0.0, 0.0], "steps": [0.0, 0.0], "request": [0.0, 0.0]} for arm in arms}
    try:
        target = TargetModel(model, offload=offload)
        drafter = load_drafter("default", target)
        profile = Profile.load(args.profile, target)
        bounded = build_controller("moe-aware", lambda: profile, residency=offload.residency)
        with tqdm(total=len(prompts) * len(arms), desc="arms", file=sys.stderr) as bar:
            for index, input_ids in enumerate(prompts):
                for arm in arms[index % len(arms):] + arms[: index % len(arms)]:
                    offload.clear()
                    counter = StepCounter()
                    controller = BoundedController(bounded.sizing, bandit=BudgetBandit((arm,)))
                    start = time.perf_counter()
                    result = SpecDecoder(target, drafter, controller, observer=counter).generate(
                        input_ids, torch.ones_like(input_ids), max_new_tokens=args.max_new_tokens, eos_token_id=[])
                    wall_ms = (time.perf_counter() - start) * 1e3
                    records = counter.records  # (tokens, rows, ms) per step
                    _add(totals[arm]["settled"], records[SETTLE_STEPS:])
                    _add(totals[arm]["steps"], records)
                    totals[arm]["request"][0] += result.sequences.shape[1] - input_ids.shape[1]  # the prefill's token too
                    totals[arm]["request"][1] += wall_ms
                    bar.update(1)
    finally:
        offload.close()
    rates = {arm: {way: made / ms for way, (made, ms) in ways.items()} for arm, ways in totals.items()}  # tokens per ms
    print(f"tokens per ms x plain, C = {args.resident_experts}, {args.prompts} ({len(prompts)} prompts)")
    print(f"{'arm':<10} {'after ' + str(SETTLE_STEPS) + ' steps':>14} {'every step':>11} {'with prefill':>13}")
    base = rates.get("plain") or next(iter(rates.values()))
    for arm, ways in rates.items():
        print(f"{arm:<10} " + " ".join(f"{ways[w] / base[w]:>{n}.3f}" for w, n in
                                       (("settled", 14), ("steps", 11), ("request", 13))))
    report = {"command": "arm_settle_check", "prompts": str(args.prompts), "resident_experts": args.resident_experts,
              "settle_steps": SETTLE_STEPS, "rates_per_ms": rates,
              "tokens": {arm: {way: made for way, (made, _ms) in ways.items()} for arm, ways in totals.items()}}
    print(json.dumps(report))
    return report


def _add(total: list[float], records) -> None:
    for tokens, _rows, ms in records:
        total[0] += tokens
        total[1] += ms


if __name__ == "__main__":
    main()
