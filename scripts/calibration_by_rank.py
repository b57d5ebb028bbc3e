"""Is a draft node's rank among its siblings informative beyond its conditional q? Decodes the
profiling prompts greedily with EAGLE-2 trees (the profiler's decoding) and tabulates, per depth and
q band, how often a parent's first child and its later siblings were accepted, beside what one map
over both (rank ignored) and the profile's own maps predict.

    python scripts/calibration_by_rank.py --prompts configs/bench/profile.jsonl [--max-prompts N]

Prints the table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch

from moe_spec.core.target import TargetModel
from moe_spec.experiments.prompt_file import in_class_turns, load_prompts
from moe_spec.loading import load_drafter, load_target, load_tokenizer
from moe_spec.measure.decoding import decode_prompts
from moe_spec.measure.store import DEFAULT_PROFILE
from moe_spec.profile.artifact import Profile
from moe_spec.profile.calibration import IsotonicMap, NodeSamples

BANDS = ((0.0, 0.05), (0.05, 0.1), (0.1, 0.2), (0.2, 0.4), (0.4, 0.7), (0.7, 1.01))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--profile", default=str(DEFAULT_PROFILE))
    parser.add_argument("--max-prompts", type=int, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args()
    torch.set_num_threads(1)
    target = TargetModel(load_target(None))
    tokenizer = load_tokenizer(None)
    profile = Profile.load(args.profile, target)
    prompts = [p.input_ids(tokenizer)[0] for p in in_class_turns(load_prompts(args.prompts))][: args.max_prompts]
    traces = decode_prompts(target, load_drafter("default", target), prompts, args.max_new_tokens)
    samples = NodeSamples.from_steps([s for t in traces for s in t.steps])
    reached = samples.parent_reached
    rows = []
    for depth in (1, 2):
        at = reached & (samples.depth == depth)
        pooled = IsotonicMap.fit(samples.conditional_q[at], samples.conditional_accepted[at])
        for low, high in BANDS:
            for first in (True, False):
                mask = at & (samples.top == first) & (samples.conditional_q >= low) & (samples.conditional_q < high)
                if mask.sum() < 5:
                    continue
                q = samples.conditional_q[mask]
                rows.append({"depth": depth, "q": [low, high], "first_child": first, "nodes": int(mask.sum()),
                             "accepted": float(samples.conditional_accepted[mask].mean()),
                             "one_map": float(pooled(q).mean()),
                             "profile": float(profile.calibration.conditional_map(depth, first)(q).mean())})
    print(f"{'depth':>5s} {'q':>12s} {'child':>6s} {'nodes':>6s} {'accepted':>9s} {'one map':>8s} {'profile':>8s}")
    for r in rows:
        print(f"{r['depth']:5d} {r['q'][0]:5.2f}-{r['q'][1]:<5.2f} {'first' if r['first_child'] else 'later':>6s} "
              f"{r['nodes']:6d} {r['accepted']:9.3f} {r['one_map']:8.3f} {r['profile']:8.3f}")
    print(json.dumps({"command": "calibration_by_rank", "prompts": len(prompts), "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
