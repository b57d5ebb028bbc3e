"""Add acceptance per sampling setting and candidate scheme to an existing profile (the sampling
stage of `moe-spec profile`, run on its own so the greedy cost model stays as measured).

    python scripts/profile_sampling.py --profile moe_spec/assets/default_profile.json \
        --prompts configs/bench/profile.jsonl --settings 1.0 0.7:0.9 [--max-prompts 8]

A setting is TEMPERATURE[:TOP_P[:TOP_K]]. Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import torch
from tqdm import tqdm

from moe_spec.core.drafting import EAGLE2_BUDGET
from moe_spec.core.sampling import SamplingConfig
from moe_spec.core.target import TargetModel
from moe_spec.experiments.prompt_file import in_class_turns, load_prompts
from moe_spec.loading import load_drafter, load_target, load_tokenizer
from moe_spec.measure.sampling_profile import decodes_per_setting, sampling_acceptance
from moe_spec.profile.artifact import Profile


def setting(text: str) -> SamplingConfig:
    parts = text.split(":")
    try:
        temperature = float(parts[0])
        top_p = float(parts[1]) if len(parts) > 1 else 1.0
        top_k = int(parts[2]) if len(parts) > 2 else 0
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"a setting is TEMPERATURE[:TOP_P[:TOP_K]], got {text!r}") from error
    return SamplingConfig(temperature, top_k, top_p)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", required=True)
    parser.add_argument("--out", default=None, help="where to write (default: over --profile)")
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--model", default=None, help="target folder (default: the embedded target)")
    parser.add_argument("--drafter", default="default", help="the drafter the profile was made with (as --drafter elsewhere)")
    parser.add_argument("--settings", type=setting, nargs="+", required=True)
    parser.add_argument("--max-prompts", type=int, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--sampled-chain", type=int, default=5,
                        help="nodes of the chains the sampled calibration is fitted on (0: the reference budget's trees)")
    args = parser.parse_args(argv)
    if args.sampled_chain < 0:
        parser.error(f"--sampled-chain must be >= 0, got {args.sampled_chain}")
    torch.set_num_threads(args.threads)
    model = load_target(args.model)
    target = TargetModel(model)
    tokenizer = load_tokenizer(args.model)
    profile = Profile.load(args.profile, target)
    drafter = load_drafter(args.drafter, target)
    prompts = [p.input_ids(tokenizer)[0] for p in in_class_turns(load_prompts(args.prompts))][: args.max_prompts]
    start = time.perf_counter()
    chain = args.sampled_chain or None
    total = len(prompts) * decodes_per_setting(chain) * len(args.settings)
    with tqdm(total=total, desc="sampling acceptance", file=sys.stderr) as bar:
        entries = sampling_acceptance(target, drafter, prompts, args.settings, EAGLE2_BUDGET, args.max_new_tokens,
                                      tick=bar.update, sampled_chain=chain)
    profile = dataclasses.replace(profile, sampling_acceptance=entries)
    profile.save(args.out or args.profile)
    print(f"{'setting':40s} {'scheme':8s} {'accepted/step':>14s} {'steps':>6s} calibrated on")
    for e in entries:
        print(f"{e.label:40s} {'sampled' if e.sampled else 'top':8s} {e.mean_accepted:14.3f} {e.steps:6d} {e.calibration_shape}")
    print(json.dumps({"profile": args.out or args.profile, "seconds": round(time.perf_counter() - start, 1),
                      "entries": [{k: v for k, v in e.to_dict().items() if k != "calibration"} for e in entries]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
