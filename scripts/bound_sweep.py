"""The bound's bandit settings swept on replays: what choosing online costs against the best arm in
hindsight, per setting, on greedy traces (`moe-spec bench --trace`). A SIMULATION: every arm's
step is its replay under the trace's profile (see `moe_spec/experiments/replay.py`), jittered by
`--noise` (live step times move; a replay's do not), over `--seeds` jitters.

    python scripts/bound_sweep.py --trace runs/traces/greedy_shipped.jsonl --exploration 0.35,0.7,1.4 --window 32,96

Tune on one prompt set's trace, read the other's: the held-out set is never tuned on. Prints a
table per trace and one JSON line.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from dataclasses import replace

from moe_spec.experiments.bound_replay import BoundSettings, replay_bound
from moe_spec.experiments.replay import bound_arms, summarise
from moe_spec.experiments.trace_file import read_trace
from moe_spec.policy.bounded_controller import FIXED_ARMS


def arms_of(path: str, fixed_nodes=FIXED_ARMS) -> tuple[list[int], dict]:
    """Each step's prompt and every arm's replayed steps on the trace at `path` (greedy)."""
    trace = read_trace(path)
    if not trace.greedy:
        raise SystemExit(f"{path}: a sampled trace; the bound is replayed on greedy traces only")
    profile = trace.profile()
    sized, fixed, plain = bound_arms(trace, profile, 1.0, fixed_nodes)
    return [step.rows[0] for step in trace.steps], {"sized": sized, "fixed": fixed, "plain": plain,
                                                    "prior": greedy_prior(profile)}


def greedy_prior(profile) -> tuple[tuple[str, float], ...]:
    """The arms' rates the profile measured greedy, one row, every expert resident (as a live
    bound's prior in that regime; () where it measured none)."""
    for entry in profile.arm_rates:
        if entry.sampling.greedy and entry.rows == 1 and entry.resident_experts is None:
            return tuple(entry.rates.items())
    return ()


def rate(steps) -> float:
    return summarise(steps)["tokens_per_s"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", action="append", required=True, help="a greedy bench trace (repeatable)")
    parser.add_argument("--exploration", default="0.7")
    parser.add_argument("--window", default="32")
    parser.add_argument("--min-plays", default="3")
    parser.add_argument("--horizon", default="none", help="steps after which evidence is forgotten (none: never, the default)")
    parser.add_argument("--fixed", default=",".join(map(str, FIXED_ARMS)), help="the fixed budgets, in the order tried")
    parser.add_argument("--noise", type=float, default=0.08, help="relative spread of each step's ms (lognormal)")
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--request-prior-steps", default="none",
                        help="arms judged at the request's difficulty, shrunk towards the run's by this many steps "
                             "(none: at the run's, the default)")
    parser.add_argument("--prior", action="store_true",
                        help="start the bandit from the arm rates the trace's profile measured (greedy, one row), as live")
    parser.add_argument("--sized-scale", type=float, default=1.0,
                        help="multiply the sizing's replayed ms by this (a replay flatters the sizing: it picks from "
                             "EAGLE-2's full tree; scale it to where a live run measures it against the fixed trees)")
    args = parser.parse_args(argv)
    grid = list(itertools.product([float(x) for x in args.exploration.split(",")], [int(x) for x in args.window.split(",")],
                                  [int(x) for x in args.min_plays.split(",")],
                                  [None if x == "none" else int(x) for x in args.horizon.split(",")],
                                  [None if x == "none" else float(x) for x in args.request_prior_steps.split(",")]))
    results = {}
    fixed = tuple(int(n) for n in args.fixed.split(","))
    for path in args.trace:
        prompts, arms = arms_of(path, fixed)
        arms["sized"] = [replace(s, verify_ms=s.verify_ms * args.sized_scale, draft_ms=s.draft_ms * args.sized_scale)
                         for s in arms["sized"]]
        print("arms (replayed tok/s): " + ", ".join(
            f"{name} {rate(steps):.1f}" for name, steps in [("sized", arms["sized"]), ("plain", arms["plain"]),
                                                           *((f"static:{n}", st) for n, st in sorted(arms["fixed"].items()))]))
        best = max([arms["sized"], arms["plain"], *arms["fixed"].values()], key=rate)
        print(f"{path}: {len(prompts)} steps; best arm in hindsight {rate(best):.1f} tok/s (replayed)")
        print("exploration  window  min_plays  horizon  request  bound/best (mean over seeds)  min")
        rows = []
        for exploration, window, min_plays, horizon, request in grid:
            ratios = []
            for seed in range(args.seeds):
                settings = BoundSettings(exploration=exploration, window=window, min_plays=min_plays,
                                         horizon=horizon, fixed=fixed, noise=args.noise, seed=seed,
                                         request_prior_steps=request,
                                         priors=arms["prior"] if args.prior else ())
                chosen, _ = replay_bound(prompts, arms["sized"], arms["fixed"], arms["plain"], settings)
                ratios.append(rate(chosen) / rate(best))
            rows.append({"exploration": exploration, "window": window, "min_plays": min_plays, "horizon": horizon,
                         "request_prior_steps": request,
                         "mean": round(statistics.mean(ratios), 4), "min": round(min(ratios), 4)})
            print(f"{exploration:11.2f}  {window:6d}  {min_plays:9d}  {horizon!s:>7}  {request!s:>7}"
                  f"  {rows[-1]['mean']:28.3f}"
                  f"  {rows[-1]['min']:.3f}")
        results[path] = rows
    print(json.dumps({"command": "bound_sweep", "simulation": True, "noise": args.noise, "seeds": args.seeds,
                      "prior": args.prior,
                      "sized_scale": args.sized_scale, "results": results}))


if __name__ == "__main__":
    main()
