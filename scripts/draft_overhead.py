"""What drafting pays for the controller's asks: one candidate tree drafted plainly, with node features, with a depth pricer.

    python scripts/draft_overhead.py [--batch-size 1] [--nodes 8] [--depth 4] [--repeats 60]
                                     [--prompts configs/bench/profile.jsonl] [--threads 1]

The embedded EAGLE head drafts the same budget (`--nodes` per row, `--depth` deep, EAGLE-2's
branching for that many nodes, as `moe-aware` sizes its candidates) for the first `--batch-size`
prompts, four ways interleaved: plainly (what `static:N` asks), with each node's parent head output
carried (`TreeBudget.node_features`, what the head routing predictor reads), with a `DepthPricer`
(`TreeBudget.pricer`, which asks before each depth whether it could pay) and with both. The pricer
here never stops a row (a rate of 1e-9 tokens a ms makes every node pay), so all four draft the
same trees, which is checked, and only the asks' own work differs. Between calls 64 MB are
rewritten, as a target forward would evict the caches. Prints the median ms of each and, last,
one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from moe_spec.core.drafting import TreeBudget
from moe_spec.core.sampling import SamplingConfig
from moe_spec.core.target import TargetModel
from moe_spec.experiments.prompt_file import load_prompts
from moe_spec.loading import load_drafter, load_target, load_tokenizer
from moe_spec.policy.draft_pricing import DepthPricer
from moe_spec.profile.artifact import Profile
from moe_spec.testing.helpers import target_features

ROOT = Path(__file__).resolve().parents[1]
WAYS = ("plain", "features", "pricer", "both")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--prompts", default=str(ROOT / "configs/bench/profile.jsonl"))
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    for name in ("batch_size", "nodes", "depth", "repeats", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    torch.set_num_threads(args.threads)
    target, tokenizer = TargetModel(load_target()), load_tokenizer()
    prompts = [p.input_ids(tokenizer)[0] for p in load_prompts(args.prompts)][:args.batch_size]
    if len(prompts) < args.batch_size:
        parser.error(f"--batch-size {args.batch_size}: {args.prompts} holds only {len(prompts)} prompts")
    calibration = Profile.load(ROOT / "moe_spec/assets/default_profile.json").calibration
    drafter = load_drafter("default", target)
    with torch.no_grad():
        features = [target_features(target, p[:-1]) for p in prompts]
    drafter.begin([p[:-1] for p in prompts], features)
    roots, depths = [int(p[-1]) for p in prompts], [args.depth] * len(prompts)
    branching = max(2, -(-args.nodes // args.depth))

    def budget(way: str) -> TreeBudget:
        pricer = DepthPricer(calibration, lambda depth: 1.0, 1e-9, 0.0, 0.0) if way in ("pricer", "both") else None
        return TreeBudget(args.nodes, args.depth, branching, node_features=way in ("features", "both"), pricer=pricer)

    greedy, evict = SamplingConfig(), torch.randn(4096, 4096)
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    trees: dict[str, list] = {}
    for _ in range(args.repeats):
        for way in WAYS:
            asked = budget(way)
            evict.mul_(1.0)
            start = time.perf_counter()
            drafted = drafter.propose(roots, asked, depths, greedy)
            times[way].append(time.perf_counter() - start)
            trees[way] = [tree.tokens.tolist() for tree in drafted]
    if any(trees[way] != trees["plain"] for way in WAYS):
        raise RuntimeError("the four ways drafted different trees: the pricer stopped a row")
    ms = {way: round(float(np.median(times[way])) * 1000, 3) for way in WAYS}
    print(f"B = {args.batch_size}, {args.nodes} nodes {args.depth} deep, median of {args.repeats}: "
          + ", ".join(f"{way} {value} ms" for way, value in ms.items()))
    print(json.dumps({"batch_size": args.batch_size, "nodes": args.nodes, "depth": args.depth,
                      "repeats": args.repeats, "ms": ms,
                      "features_ms": round(ms["features"] - ms["plain"], 3),
                      "pricer_ms": round(ms["pricer"] - ms["plain"], 3)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
