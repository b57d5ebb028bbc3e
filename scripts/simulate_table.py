"""The replayed decomposition per regime (a SIMULATION), from scripts/simulate_regimes.sh's reports:
one markdown row per regime and prompt set.

    python scripts/simulate_table.py [FOLDER]    (default analysis/results/controller_regimes)

Columns: the sizing (`moe-aware` with its gate) and the best fixed tree in hindsight as replayed
(every policy charged EAGLE-2's recorded draft time), both x `ar`; the same with each charged the
draft of what it verified (`sized draft`); the sized ceiling x `ar`; the parts of the sizing's gap to
it (acceptance foresight, routing prediction, drafting a larger tree than verified, each a ratio of
replayed throughputs: > 1 is what removing it gains); the bound replayed against its best arm (the
online choice's cost; greedy traces only); the tokens a step the sizing expected of its choices
against those they made. Prints the table and, last, one JSON line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REGIMES = ("greedy", "t1", "offload8", "offload16", "offload32", "offload16_t1")
LABELS = {"greedy": "greedy", "t1": "T = 1", "offload8": "offload C = 8", "offload16": "offload C = 16",
          "offload32": "offload C = 32", "offload16_t1": "offload C = 16, T = 1"}
BOUNDED = "moe-aware, bounded (replay)"


def row(report: dict) -> dict:
    result = report["results"][0]
    policies, parts = result["policies"], result["decomposition"]["moe-aware"]
    speedup = {name: figures["speedup_vs_ar"] for name, figures in policies.items()}
    sizing = policies["moe-aware"]
    bound = policies.get(BOUNDED)
    return {
        "sizing": speedup["moe-aware"], "static_best": speedup["static-best"],
        "static_best_budget": policies["static-best"].get("budget"),
        "sizing_sized_draft": speedup["moe-aware, sized draft (bound)"],
        "static_best_sized_draft": speedup["static-best, sized draft (bound)"],
        "sized_ceiling": speedup["ceiling, sized draft (bound)"],
        "acceptance_foresight": parts["calibration"], "routing": parts["routing"], "drafting": parts["drafting"],
        "bound_vs_best_arm": (round(bound["tokens_per_s"] / bound["arm_tokens_per_s"][bound["best_arm"]], 3)
                              if bound else None),
        "expected_tokens": sizing.get("predicted_accept_len"), "made_tokens": sizing["mean_accept_len"],
    }


def main(argv: list[str]) -> int:
    folder = Path(argv[0]) if argv else Path("analysis/results/controller_regimes")
    rows = {}
    print("| regime | set | sizing / static-best, replayed | sized draft | sized ceiling | foresight | routing | "
          "drafting | bound / best arm | tokens expected / made |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for regime in REGIMES:
        for prompt_set in ("shipped", "heldout"):
            path = folder / f"simulate_{regime}_{prompt_set}.json"
            if not path.is_file():
                continue
            r = rows[f"{regime}_{prompt_set}"] = row(json.loads(path.read_text()))
            bound = f"{r['bound_vs_best_arm']:.2f}" if r["bound_vs_best_arm"] is not None else "-"
            print(f"| {LABELS[regime]} | {prompt_set} | {r['sizing']:.2f}x / {r['static_best']:.2f}x "
                  f"(`{r['static_best_budget']}`) | {r['sizing_sized_draft']:.2f}x / {r['static_best_sized_draft']:.2f}x | "
                  f"{r['sized_ceiling']:.2f}x | {r['acceptance_foresight']:.2f} | {r['routing']:.2f} | "
                  f"{r['drafting']:.2f} | {bound} | {r['expected_tokens']:.2f} / {r['made_tokens']:.2f} |")
    print(json.dumps({"command": "simulate_table", "simulation": True, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
