"""What `BudgetBandit` loses to the best arm on short runs, by the error of its measured prior and
its exploration: a SIMULATION with made-up arms, not a measurement of the controller.

Each simulated run has `--steps` steps over seven arms whose rates sit as the T = 1 arms of the
embedded pair do (the best, two within 5-7%, four 10-20% behind). A step makes 1-5 tokens (uniform,
as accepted lengths swing) times its request's difficulty, drawn anew every `--request` steps and
shared by every arm (the prompt mix: code, prose, copies and random text accept very differently),
in a time of 3 / rate ms +-20%. Each step carries a reference, the tokens its first drafted node
alone would make (1, or 1 + 0.8 difficulty where the step made more than 1 x difficulty), which
the bandit adjusts arms' tokens to where `--adjust` says so. The profile's prior is each arm's rate times a factor within
+-`--prior-noise`, or, in the "swap" case, the two best arms exchanged by `--swap` of a rate, or,
in the "tilt" case, the arms' rates as the prior has them times their tokens a step to the power
`--slope` (the run's prompts accept less than the profile's, or its misses cost more: the larger
trees lose most). `--tilt 1` gives the bandit each arm's tokens a step with its prior.

    python scripts/bandit_prior_sim.py --prior-error 0.25,0.18,0.125 --exploration 0.35,0.5,0.7 --adjust 0,1
    python scripts/bandit_prior_sim.py --prior-error 0.25 --exploration 0.7 --adjust 1 --tilt 0,1

Prints a table (mean and 90th-percentile regret against the best arm, per prior case) and one
JSON line.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics

from moe_spec.core.sampling import GREEDY
from moe_spec.policy.budget_bandit import BudgetBandit, RegimeKey

KEY = RegimeKey.of(GREEDY, 1)
ARMS = {"sized": 0.93, "chain:1": 0.95, "chain:2": 1.0, "chain:3": 0.9, "chain:4": 0.88, "chain:6": 0.85, "plain": 0.8}
# tokens a step of each, as the profile's arm stage measures them (made up near the embedded pair's T = 1 arms)
TOKENS = {"sized": 2.2, "chain:1": 1.6, "chain:2": 1.9, "chain:3": 2.1, "chain:4": 2.2, "chain:6": 2.3, "plain": 1.0}


def run(bandit: BudgetBandit, rates: dict[str, float], steps: int, request: int, seed: int) -> float:
    """One simulated run; returns its regret: the mean shortfall of the chosen arms' rates against
    the best rate."""
    rng = random.Random(seed)
    best, lost = max(rates.values()), 0.0
    for step in range(steps):
        if step % request == 0:
            difficulty = rng.uniform(0.6, 1.4)
        arm = bandit.choose(KEY)
        made = rng.randint(1, 5)
        bandit.record(KEY, arm, made * difficulty, 3 / rates[arm] * rng.uniform(0.8, 1.2),
                      reference=1 + 0.8 * difficulty * (made > 1))
        lost += 1 - rates[arm] / best
    return lost / steps


def rates_and_prior(case: str, seed: int, noise: float, swap: float, slope: float = -0.4) -> tuple[dict[str, float], dict[str, float]]:
    """(the run's rates, the prior) for one simulated run."""
    if case == "tilt":
        return {arm: rate * TOKENS[arm] ** slope for arm, rate in ARMS.items()}, dict(ARMS)
    if case == "swap":
        rates = dict(ARMS, **{"chain:1": 1.0 - swap})
        return rates, dict(rates, **{"chain:1": 1.0, "chain:2": 1.0 - swap})
    rng = random.Random(1000 + seed)
    return dict(ARMS), {arm: rate * rng.uniform(1 - noise, 1 + noise) for arm, rate in ARMS.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prior-error", default="0.25,0.18,0.125",
                        help="the prior's relative error (its weight: the steps of the run's spread that make it)")
    parser.add_argument("--exploration", default="0.35,0.5,0.7")
    parser.add_argument("--adjust", default="0,1", help="adjust arms' tokens to the steps' references (0/1)")
    parser.add_argument("--steps", type=int, default=250, help="steps a run (a bench set's regime is 200-400)")
    parser.add_argument("--request", type=int, default=40, help="steps a request (its difficulty is shared)")
    parser.add_argument("--prior-noise", type=float, default=0.08)
    parser.add_argument("--swap", type=float, default=0.10)
    parser.add_argument("--slope", type=float, default=-0.4, help="the tilt case's slope of log rate on log tokens")
    parser.add_argument("--tilt", default="0", help="give the bandit the arms' tokens a step, to tilt its prior by (0/1)")
    parser.add_argument("--seeds", type=int, default=30)
    args = parser.parse_args()
    cases = ("noisy", "swap", "tilt")
    rows = []
    print(f"SIMULATION: {args.steps} steps, requests of {args.request}; regret = mean shortfall against the best arm")
    print("tilt  adjust  prior_error  exploration  " + "  ".join(f"{c:>22s}" for c in cases))
    for tilt, adjust, prior_error, exploration in itertools.product([bool(int(x)) for x in args.tilt.split(",")],
                                                                    [bool(int(x)) for x in args.adjust.split(",")],
                                                                    [float(x) for x in args.prior_error.split(",")],
                                                                    [float(x) for x in args.exploration.split(",")]):
        row = {"tilted": tilt, "adjust": adjust, "prior_error": prior_error, "exploration": exploration}
        for case in cases:
            regrets = []
            for seed in range(args.seeds):
                rates, prior = rates_and_prior(case, seed, args.prior_noise, args.swap, args.slope)
                bandit = BudgetBandit(tuple(rates), exploration=exploration, prior_error=prior_error, priors={KEY: prior},
                                      adjust=adjust, prior_tokens={KEY: TOKENS} if tilt else None)
                regrets.append(run(bandit, rates, args.steps, args.request, seed))
            regrets.sort()
            row[case] = {"mean": round(statistics.mean(regrets), 4), "p90": round(regrets[int(0.9 * len(regrets))], 4)}
        rows.append(row)
        print(f"{tilt:4d}  {adjust:6d}  {prior_error:11.3f}  {exploration:11.2f}  " + "  ".join(
            f"{row[c]['mean']:10.3f} (p90 {row[c]['p90']:.3f})" for c in cases))
    print(json.dumps({"command": "bandit_prior_sim", "simulation": True, "steps": args.steps, "request": args.request,
                      "prior_noise": args.prior_noise, "swap": args.swap, "slope": args.slope, "seeds": args.seeds, "rows": rows}))


if __name__ == "__main__":
    main()
