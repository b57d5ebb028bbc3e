"""What `BudgetBandit` loses to the best constant chain with and without adjusting each arm's tokens to
the steps' references: a SIMULATION with made-up chains, not a measurement of the controller.

Each simulated run decodes `--steps` steps with the bandit choosing among chains of 1, 2, 3, 4 and 6
nodes and plain decoding, as the bounded controller does at T = 1. A request of `--request` steps
has its own difficulty d (uniform 0.4-1.1); each step's nodes are accepted with chances
min(0.97, d x uniform(0.2, 1.3)), so a chain of k nodes makes 1 + a_1 + a_1 a_2 + ... (its expected
tokens given the drafts, as `fewer_nodes` tells them) in 10 + 2.2 k ms +-10%. As live, a chain's step
credits every shorter chain with its tokens on the same step and every drafting step tells its
reference, 1 + a_1. Regret is the run's tokens per ms against the best constant arm's on the same
steps.

    python scripts/bandit_reference_sim.py [--seeds 40]

Prints a table (regret, and the steps each arm decided) and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics

from moe_spec.core.sampling import SamplingConfig
from moe_spec.policy.budget_bandit import BudgetBandit, RegimeKey

KEY = RegimeKey.of(SamplingConfig(temperature=1.0), 1)
NODES = {"chain:1": 1, "chain:2": 2, "chain:3": 3, "chain:4": 4, "chain:6": 6, "plain": 0}


def chain_tokens(accepts: list[float], nodes: int) -> float:
    """1 + a_1 + a_1 a_2 + ... over the chain's first `nodes` nodes."""
    total = reach = 1.0
    for chance in accepts[:nodes]:
        reach *= chance
        total += reach
    return total


def step_ms(nodes: int) -> float:
    return 10.0 + 2.2 * nodes


def run(adjust: bool, seed: int, steps: int, request: int) -> tuple[float, dict[str, int]]:
    """One simulated run: (its regret against the best constant arm, the steps each arm decided)."""
    rng = random.Random(seed)
    bandit = BudgetBandit(tuple(NODES), adjust=adjust)
    made, constant, decided = 0.0, dict.fromkeys(NODES, 0.0), dict.fromkeys(NODES, 0)
    for step in range(steps):
        if step % request == 0:
            difficulty = rng.uniform(0.4, 1.1)
        accepts = [min(0.97, difficulty * rng.uniform(0.2, 1.3)) for _ in range(max(NODES.values()))]
        arm = bandit.choose(KEY)
        nodes = NODES[arm]
        credits = {name: chain_tokens(accepts, k) for name, k in NODES.items() if k < nodes}
        bandit.record(KEY, arm, chain_tokens(accepts, nodes), step_ms(nodes) * rng.uniform(0.9, 1.1),
                      credits=credits, reference=1 + accepts[0] if nodes else None)
        made += chain_tokens(accepts, nodes) / step_ms(nodes)
        decided[arm] += 1
        for name, k in NODES.items():
            constant[name] += chain_tokens(accepts, k) / step_ms(k)
    return 1 - made / max(constant.values()), decided


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="steps a run (a bench set's regime is 200-400)")
    parser.add_argument("--request", type=int, default=40, help="steps a request (its difficulty is shared)")
    parser.add_argument("--seeds", type=int, default=40)
    args = parser.parse_args()
    rows = []
    print(f"SIMULATION: {args.steps} steps, requests of {args.request}, {args.seeds} runs; "
          "regret = shortfall against the best constant arm")
    print("adjust  mean regret  p90 regret  steps decided")
    for adjust in (False, True):
        regrets, decided = [], dict.fromkeys(NODES, 0)
        for seed in range(args.seeds):
            regret, counts = run(adjust, seed, args.steps, args.request)
            regrets.append(regret)
            for arm, count in counts.items():
                decided[arm] += count
        regrets.sort()
        shares = {arm: round(count / sum(decided.values()), 3) for arm, count in decided.items()}
        rows.append({"adjust": adjust, "mean": round(statistics.mean(regrets), 4),
                     "p90": round(regrets[int(0.9 * len(regrets))], 4), "decided": shares})
        print(f"{adjust:6d}  {rows[-1]['mean']:11.3f}  {rows[-1]['p90']:10.3f}  "
              + ", ".join(f"{arm} {share:.0%}" for arm, share in shares.items()))
    print(json.dumps({"command": "bandit_reference_sim", "simulation": True, "steps": args.steps,
                      "request": args.request, "seeds": args.seeds, "rows": rows}))


if __name__ == "__main__":
    main()
