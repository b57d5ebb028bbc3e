"""Refit an existing profile's greedy acceptance calibration (the calibration stage of `moe-spec
profile`, run on its own so the cost model, routing and head predictor stay as measured): the
prompts decoded greedily with the profiler's candidate trees, the maps fitted, the cross-fitted
report replaced in `details`.

    python scripts/refit_calibration.py --profile moe_spec/assets/default_profile.json \
        --prompts configs/bench/profile.jsonl

Prints the calibration report and, last, one JSON line. Sampling settings' calibrations are
refitted by `scripts/profile_sampling.py`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import torch
from tqdm import tqdm

from moe_spec.core.target import TargetModel
from moe_spec.experiments.prompt_file import in_class_turns, load_prompts
from moe_spec.loading import load_drafter, load_target, load_tokenizer
from moe_spec.measure.decoding import decode_prompts
from moe_spec.measure.profiler import ProfileSettings
from moe_spec.profile.artifact import Profile
from moe_spec.profile.calibration import AcceptanceCalibration, NodeSamples, cross_fitted_report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", required=True)
    parser.add_argument("--out", default=None, help="where to write (default: over --profile)")
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--max-prompts", type=int, default=None, help="the first N prompts only")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = TargetModel(load_target(None))
    tokenizer = load_tokenizer(None)
    profile = Profile.load(args.profile, target)
    drafter = load_drafter("default", target)
    prompts = [p.input_ids(tokenizer)[0] for p in in_class_turns(load_prompts(args.prompts))][: args.max_prompts]
    settings = ProfileSettings()  # the profiler's decoding: its prompt length and candidate trees
    start = time.perf_counter()
    with tqdm(total=len(prompts), desc="greedy decoding", file=sys.stderr) as bar:
        traces = decode_prompts(target, drafter, prompts, settings.max_new_tokens, settings.candidate_budget, bar.update)
    steps = [s for t in traces for s in t.steps]
    groups = [t.prompt_index for t in traces for _ in t.steps]
    calibration = AcceptanceCalibration.fit(NodeSamples.from_steps(steps, groups))
    report = cross_fitted_report(steps, groups).to_dict()
    profile = dataclasses.replace(profile, calibration=calibration, details={**profile.details, "calibration": report})
    profile.save(args.out or args.profile)
    for key, value in report.items():
        print(f"{key:28s} {value:.4f}" if isinstance(value, float) else f"{key:28s} {value}")
    print(json.dumps({"profile": args.out or args.profile, "seconds": round(time.perf_counter() - start, 1),
                      "steps": len(steps), "calibration": report}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
