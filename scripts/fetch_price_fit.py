"""What an offloaded run's verify passes cost against the profile's prices: its compute and its reads
fitted apart. A MEASUREMENT on this machine's store.

Each request is decoded by each of `moe-aware`'s arms in turn (plain decoding, fixed trees, the
sizing), each from a cold cache, so the passes range from few reads (a warm plain step) to many (a
tree's first pass). For every one-row pass it records the profile's predicted compute time c (its
tokens and the experts it loaded), the profile's predicted fetch time f (the experts it read, at the
run's cache size) and the measured verify time m, then fits, on the even requests, and scores, by
the median relative error on the odd ones:

- one scale, as the online correction learnt before it priced reads apart: m = a1 c + f;
- two: m = a c + b f, least squares in relative error;

and, for the online estimator `CostCorrection` fed every pass in order, how far each pass's time
sits from what it predicted just before (median relative error): learning the speed alone beyond
reads at the profile's price (`moe-aware-profilefetch`), or the price of reads too, at each
`--memories` (the fit's decay per pass, `CostCorrection.fetch_memory`).

    python scripts/fetch_price_fit.py --prompts configs/bench/heldout.jsonl --limit 8 \\
        --json analysis/results/offload/fetch_correction/fit_shipped.json

Prints a summary and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from moe_spec.cli.json_output import write_json
from moe_spec.cli.profile import read_prompts
from moe_spec.core.engine import SpecDecoder
from moe_spec.core.sampling import GREEDY
from moe_spec.core.step_record import DecodeObserver
from moe_spec.core.target import TargetModel
from moe_spec.loading import load_drafter, load_target, load_tokenizer
from moe_spec.offload.offloaded_experts import OffloadConfig, offload_experts
from moe_spec.policy.bounded_controller import BoundedController
from moe_spec.policy.budget_bandit import BudgetBandit
from moe_spec.policy.online_correction import CostCorrection
from moe_spec.policy.registry import build_controller
from moe_spec.profile.artifact import Profile


class _Passes(DecodeObserver):
    """(predicted compute ms, predicted fetch ms, measured ms) of each one-row pass, with its request."""

    def __init__(self, cost, fetch):
        self.cost, self.fetch = cost, fetch
        self.request = 0
        self.passes: list[tuple[int, float, float, float]] = []

    def on_step(self, record) -> None:
        if record.verified.rows != 1 or record.fetch is None:
            return
        unique = record.routing.unique_per_layer()  # [L] experts the pass loaded
        compute = self.cost.predict_ms(record.verified.pass_tokens, unique)
        fetch = self.fetch.total_ms(record.fetch.per_layer_misses, unique)
        self.passes.append((self.request, compute, fetch, record.verify_ms))


def fit_two(c: np.ndarray, f: np.ndarray, m: np.ndarray) -> tuple[float, float]:
    """(a, b) of m = a c + b f, least squares in relative error."""
    design = np.stack([c / m, f / m], axis=1)  # [P, 2]
    (a, b), *_ = np.linalg.lstsq(design, np.ones_like(m), rcond=None)
    return float(a), float(b)


def fit_one(c: np.ndarray, f: np.ndarray, m: np.ndarray) -> float:
    """a1 of m = a1 c + f: the geometric mean of (m - f) / c, as the online scale averages logs."""
    return float(np.exp(np.mean(np.log(np.maximum(m - f, 1e-3) / c))))


def median_error(predicted: np.ndarray, m: np.ndarray) -> float:
    return float(np.median(np.abs(predicted - m) / m))


def online_error(passes, memory: float | None) -> tuple[float, CostCorrection]:
    """The median relative error of each pass's time against what `CostCorrection` predicted for it
    from the passes before (`memory` None: reads at the profile's price, the speed alone learnt)."""
    correction = CostCorrection() if memory is None else CostCorrection(fetch_memory=memory)
    errors = []
    for _, compute, fetch, measured in passes:
        predicted = correction.scale * compute + correction.fetch_scale * fetch
        errors.append(abs(predicted - measured) / measured)
        if memory is None:
            correction.update(compute, measured - fetch)
        else:
            correction.update(compute, measured, fetch_ms=fetch)
    return float(np.median(errors)), correction


def decode(args, profile: Profile) -> list[tuple[int, float, float, float]]:
    model = load_target(None)
    resident = TargetModel(model)
    prompts = read_prompts(args.prompts, load_tokenizer(None), resident.vocab_size)[: args.limit]
    offload = offload_experts(model, OffloadConfig(args.offload_dir, resident=args.resident_experts))
    target = TargetModel(model, offload=offload)
    drafter = load_drafter("default", target)
    fetch = profile.cost_model.fetch.at_capacity(args.resident_experts)
    observer = _Passes(profile.cost_model, fetch)
    bounded = build_controller("moe-aware", lambda: profile, residency=offload.residency)
    bounded.begin(drafter.default_budget, GREEDY)
    arms = args.arms.split(",")
    try:
        with tqdm(total=len(prompts) * len(arms), desc="requests", file=sys.stderr) as bar:
            for index, ids in enumerate(prompts):
                observer.request = index
                for arm in arms[index % len(arms):] + arms[: index % len(arms)]:
                    offload.clear()
                    controller = BoundedController(bounded.sizing, bandit=BudgetBandit((arm,)))
                    SpecDecoder(target, drafter, controller, observer=observer).generate(
                        ids[None], max_new_tokens=args.max_new_tokens, eos_token_id=[])
                    bar.update(1)
    finally:
        offload.close()
    return observer.passes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=Path, default=Path("configs/bench/heldout.jsonl"))
    parser.add_argument("--limit", type=int, default=8, help="prompts decoded (even ones fit, odd ones score)")
    parser.add_argument("--arms", default="plain,static:1,static:4,sized")
    parser.add_argument("--resident-experts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--profile", type=Path, default=Path("analysis/results/offload/profile_disk.json"))
    parser.add_argument("--offload-dir", default="runs/expert_store/default_target-float32")
    parser.add_argument("--memories", default="0.9,0.95,0.98", help="the online fit's decays per pass to score")
    parser.add_argument("--json", default=None, help="write the report here too")
    args = parser.parse_args(argv)
    memories = [float(v) for v in args.memories.split(",")]
    if args.limit < 2:
        parser.error("--limit: at least 2 prompts (one to fit on, one to score)")
    profile = Profile.load(args.profile, TargetModel(load_target(None)))
    if profile.cost_model.fetch is None:
        parser.error(f"--profile: {args.profile} has no fetch cost (make one with scripts/profile_fetch.py)")
    passes = decode(args, profile)
    request, c, f, m = (np.array(column) for column in zip(*passes))
    train, test = request % 2 == 0, request % 2 == 1
    a1 = fit_one(c[train], f[train], m[train])
    a, b = fit_two(c[train], f[train], m[train])
    online = {}
    for memory in [None, *memories]:
        error, correction = online_error(passes, memory)
        online["profile price" if memory is None else f"memory {memory}"] = {
            "median_error": round(error, 4), "final_scale": round(correction.scale, 3),
            "final_fetch_scale": round(correction.fetch_scale, 3)}
    share = f / (a * c + b * f)
    report = {
        "passes": len(passes), "fitted_on": int(train.sum()), "scored_on": int(test.sum()),
        "read_share": {"median": round(float(np.median(share)), 3), "max": round(float(share.max()), 3)},
        "one_scale": {"a1": round(a1, 3), "held_out_median_error": round(median_error(a1 * c[test] + f[test], m[test]), 4)},
        "two_scales": {"a": round(a, 3), "b": round(b, 3),
                       "held_out_median_error": round(median_error(a * c[test] + b * f[test], m[test]), 4)},
        "two_scales_odd_requests": dict(zip(("a", "b"), (round(v, 3) for v in fit_two(c[test], f[test], m[test])))),
        "online": online,
    }
    print(f"{len(passes)} one-row passes; reads {statistics.median(share.tolist()):.0%} of a pass's time (median)")
    print(f"one scale:  m = {a1:.2f} c + f          held-out median error {report['one_scale']['held_out_median_error']:.1%}")
    print(f"two scales: m = {a:.2f} c + {b:.2f} f   held-out median error {report['two_scales']['held_out_median_error']:.1%}")
    for name, row in online.items():
        print(f"online, {name}: median error a pass ahead {row['median_error']:.1%}, ending at scale "
              f"{row['final_scale']:.2f}, fetch scale {row['final_fetch_scale']:.2f}")
    out = {"prompts": str(args.prompts), "limit": args.limit, "resident_experts": args.resident_experts,
           "profile": str(args.profile), "arms": args.arms, "threads": torch.get_num_threads(), **report}
    write_json(args.json, out)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
