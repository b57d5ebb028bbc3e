"""Reading ahead against not, per method, from two offloaded bench reports of the same prompts:
experts read per token and the verify time spent waiting on reads per token (the exposed read
time: what compute did not hide), each without / with read-ahead.

    python scripts/read_ahead_table.py analysis/results/controller_regimes/offload16_shipped.json \\
        analysis/results/controller_regimes/offload16_prefetch_shipped.json

Prints a markdown table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

METHODS = ("static:1", "static:2", "static:4", "moe-aware", "moe-aware-unbounded")


def per_token(figures: dict) -> dict:
    """Misses and exposed wait (ms) per generated token, from a method's per-step figures."""
    tokens = figures["mean_accept_len"]
    return {"misses": figures["misses_per_token"], "wait_ms": figures["fetch_wait_ms"] / tokens,
            "speedup": figures["speedup_vs_ar"]}


def table(without: dict, with_: dict, methods=METHODS) -> tuple[str, dict]:
    rows = ["| method | misses / token | exposed read ms / token | speedup over plain |", "|---|---|---|---|"]
    out = {}
    for method in methods:
        if method not in without["methods"] or method not in with_["methods"]:
            continue
        a, b = per_token(without["methods"][method]), per_token(with_["methods"][method])
        out[method] = {"without": a, "with": b}
        rows.append(f"| {method} | {a['misses']:.1f} / {b['misses']:.1f} | {a['wait_ms']:.2f} / {b['wait_ms']:.2f} "
                    f"| {a['speedup']:.2f}x / {b['speedup']:.2f}x |")
    return "\n".join(rows), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("without", type=Path, help="bench --json report without read-ahead")
    parser.add_argument("with_", type=Path, metavar="with", help="the same bench with --prefetch")
    args = parser.parse_args()
    reports = [json.loads(path.read_text()) for path in (args.without, args.with_)]
    if not all(report["config"].get("offload") for report in reports):
        raise SystemExit("both reports must come from offloaded runs (bench --offload ...)")
    text, figures = table(*reports)
    print(text)
    print(json.dumps({"command": "read_ahead_table", "without": str(args.without), "with": str(args.with_), "methods": figures}))


if __name__ == "__main__":
    main()
