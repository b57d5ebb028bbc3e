"""The controller against fixed trees per regime, from `scripts/controller_regimes.sh`'s reports.

    python scripts/regime_table.py [--results analysis/results/controller_regimes]

One markdown row per report `<regime>_<set>.json`: speedups over `ar` from that report's own
interleaved run, `moe-aware`'s ratio to the best fixed tree in hindsight (`static-best`) and to the
one chosen on the other prompts (`static-tuned`; where a report is one batch, with no other batch to
choose on, the budget best in the other set's report, marked "other set"), its worst prompt class,
its plan share and plain steps, and which arm of its bound decided what share of its steps.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

REGIMES = {
    "greedy": "greedy, B = 1", "t1": "T = 1, B = 1", "eager": "eager, greedy", "batch4": "greedy, B = 4",
    "batch16": "greedy, B = 16", "threads1": "greedy, B = 1, one thread",
    "offload16": "offload C = 16, greedy", "offload16_t1": "offload C = 16, T = 1",
    "offload8": "offload C = 8, greedy", "offload32": "offload C = 32, greedy",
    "offload16_prefetch": "offload C = 16, greedy, read ahead",
}
SETS = {"shipped": "shipped", "heldout": "held-out"}
HEADER = ("| regime | set | moe-aware | unbounded | static-tuned | static-best | moe-aware / tuned | "
          "moe-aware / best | worst class | plan / plain | steps decided by | passes; noise |")


def row(regime: str, name: str, report: dict, other: dict | None = None) -> str:
    """`other`: the other set's report of the regime, which tunes the fixed budget where this report
    has no `static-tuned`."""
    methods = report["methods"]
    ours, best = methods["moe-aware"], methods["static-best"]
    tuned, tuned_label = _tuned(methods, other)
    unbounded = methods.get("moe-aware-unbounded", {}).get("speedup_vs_ar")
    worst = min((classes["moe-aware"]["speedup_vs_ar"], label) for label, classes in report["per_class"].items())
    arms = report.get("decisions", {}).get("moe-aware", {})
    shares = ", ".join(f"{arm} {share:.0%}" for arm, share in list(arms.items())[:3])
    cells = [
        REGIMES.get(regime, regime), SETS.get(name, name), f"**{ours['speedup_vs_ar']:.2f}x**",
        f"{unbounded:.2f}x" if unbounded is not None else "-",
        f"{tuned['speedup_vs_ar']:.2f}x{tuned_label}" if tuned else "-",
        f"{best['speedup_vs_ar']:.2f}x ({best['budget']})",
        f"{ours['tokens_per_s'] / tuned['tokens_per_s']:.2f}" if tuned else "-",
        f"{ours['tokens_per_s'] / best['tokens_per_s']:.2f}",
        f"{worst[0]:.2f}x ({worst[1]})", _shares(ours), shares,
        _noise(methods),
    ]
    return "| " + " | ".join(cells) + " |"


def _tuned(methods: dict, other: dict | None) -> tuple[dict | None, str]:
    """This report's `static-tuned`, else the budget best in `other` as this report ran it, with its
    label (None where neither is there)."""
    if "static-tuned" in methods:
        return methods["static-tuned"], ""
    budget = (other or {}).get("methods", {}).get("static-best", {}).get("budget")
    if budget is None or budget not in methods:
        return None, ""
    return methods[budget], f" ({budget}, other set)"


def _shares(figures: dict) -> str:
    """Plan share of a step / share of plain steps ("-" where a report has no step records)."""
    plan, plain = figures.get("plan_share"), figures.get("plain_share")
    return "-" if plan is None or plain is None else f"{plan:.1%} / {plain:.0%}"


def _noise(methods: dict) -> str:
    """The passes and the median over methods of how far a speedup over `ar` moves between the first
    two passes, relative to its mean ("-" with one pass)."""
    plain = methods["ar"].get("tokens_per_s_by_pass") or []
    moves = []
    for name, figures in methods.items():
        passes = figures.get("tokens_per_s_by_pass") or []
        if name != "ar" and len(passes) >= 2 and len(plain) >= 2:
            first, second = passes[0] / plain[0], passes[1] / plain[1]
            moves.append(abs(first - second) / ((first + second) / 2))
    if not moves:
        return f"{len(plain) or 1}; -"
    moves.sort()
    middle = len(moves) // 2
    median = moves[middle] if len(moves) % 2 else (moves[middle - 1] + moves[middle]) / 2
    return f"{len(plain)}; {median:.1%}"


def table(results: Path) -> str:
    lines = [HEADER, "|" + "---|" * (HEADER.count("|") - 1)]
    for regime in REGIMES:
        reports = {name: json.loads(path.read_text()) for name in SETS
                   if (path := results / f"{regime}_{name}.json").is_file()}
        for name, report in reports.items():
            other = next((theirs for them, theirs in reports.items() if them != name), None)
            lines.append(row(regime, name, report, other))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=Path("analysis/results/controller_regimes"))
    print(table(parser.parse_args().results))


if __name__ == "__main__":
    main()
