"""Add the arms of moe-aware's bound, each measured on the profile's prompts, to an existing
profile (the prior its bandit starts from; `moe_spec.measure.arm_rates_stage`). Run it alone and
last: it times decoding, and the sizing arm prices with everything the profile holds.

    python scripts/profile_arm_rates.py --profile moe_spec/assets/default_profile.json \
        --prompts configs/bench/profile.jsonl --settings temperature=0 temperature=1 temperature=0.7,top_p=0.9
    python scripts/profile_arm_rates.py --profile P --prompts F --settings temperature=0 --rows 4

A setting is key=value pairs of temperature, top_k and top_p (temperature=0: greedy). Threads are
torch's own, as a user runs.
Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from tqdm import tqdm

from moe_spec.cli.option_types import sampling_label, sampling_setting
from moe_spec.core.target import TargetModel
from moe_spec.experiments.prompt_file import in_class_turns, load_prompts
from moe_spec.loading import load_drafter, load_target, load_tokenizer
from moe_spec.measure.arm_rates_stage import arm_rates_stage
from moe_spec.profile.artifact import Profile



def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", required=True)
    parser.add_argument("--out", default=None, help="where to write (default: over --profile)")
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--model", default=None, help="target folder (default: the embedded target)")
    parser.add_argument("--drafter", default="default", help="the drafter the profile was made with (as --drafter elsewhere)")
    parser.add_argument("--experts-implementation", default="grouped_mm", help="as the profile was timed with")
    parser.add_argument("--settings", type=sampling_setting, nargs="+", required=True)
    parser.add_argument("--rows", type=int, default=1,
                        help="a batch size: each request decodes this many prompts at once (entries of other sizes are kept)")
    parser.add_argument("--max-prompts", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args(argv)
    model = load_target(args.model, experts_implementation=args.experts_implementation)
    target = TargetModel(model)
    tokenizer = load_tokenizer(args.model)
    profile = Profile.load(args.profile, target)
    drafter = load_drafter(args.drafter, target)
    prompts = [p.input_ids(tokenizer)[0] for p in in_class_turns(load_prompts(args.prompts))][: args.max_prompts]
    start = time.perf_counter()
    requests = -(-len(prompts) // args.rows)
    with tqdm(total=requests * len(args.settings), desc=f"arm rates, {args.rows} row(s)", file=sys.stderr) as bar:
        entries = arm_rates_stage(target, drafter, profile, prompts, args.settings, args.max_new_tokens, rows=args.rows,
                                  tick=lambda: bar.update(1))
    measured = {(e.sampling, e.rows) for e in entries}
    kept = tuple(e for e in profile.arm_rates if (e.sampling, e.rows) not in measured)
    profile = dataclasses.replace(profile, arm_rates=kept + entries)
    profile.save(args.out or args.profile)
    for entry in entries:
        best = max(entry.rates.values())
        row = "  ".join(f"{arm} {rate / best:.3f}" for arm, rate in sorted(entry.rates.items(), key=lambda kv: -kv[1]))
        print(f"{sampling_label(entry.sampling)}, B = {entry.rows}: {row} (rate / best)")
    print(json.dumps({"profile": args.out or args.profile, "seconds": round(time.perf_counter() - start, 1),
                      "arm_rates": [e.to_dict() for e in entries]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
