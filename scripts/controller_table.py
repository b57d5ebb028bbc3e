"""The README's measured table of the controller against its anchors, from bench reports.

    python scripts/controller_table.py [--results analysis/results/controller] [--batch | --accept]

Reads `greedy_{shipped,foreign}.json`, `sampling_{shipped,foreign}.json` (both sampling settings)
and `eager_{shipped,foreign}.json` where present (with `--batch`: `batch_{4,16}.json` and
`batch_{4,16}_foreign.json`), and prints one markdown column per report: every figure is a speedup
over `ar` from that report's own interleaved run, or a ratio of two of them. With `--accept`: the
mean accepted length (bonus token included) of fixed trees of 4, 8 and 60 nodes under top-token and
sampled candidates, per sampling report that benched both.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SETS = (("shipped", "shipped"), ("foreign", "held-out"))


def batch_columns(results: Path) -> list[tuple[str, dict]]:
    """(heading, report) per column of the batch table: B = 4, then 16, each shipped then held-out."""
    out = []
    for rows_ in (4, 16):
        for suffix, name in (("", "shipped"), ("_foreign", "held-out")):
            path = results / f"batch_{rows_}{suffix}.json"
            if path.is_file():
                out.append((f"B = {rows_}, {name}", json.loads(path.read_text())))
    return out


def columns(results: Path) -> list[tuple[str, dict]]:
    """(heading, report) per table column, in the README's order."""
    out = []
    for kind, label in (("greedy", "greedy"), ("sampling", None), ("eager", "eager, greedy")):
        for stem, name in SETS:
            path = results / f"{kind}_{stem}.json"
            if not path.is_file():
                continue
            document = json.loads(path.read_text())
            if kind == "sampling":
                for setting, report in document["reports"].items():
                    pretty = "T = 1" if setting == "temperature=1" else "T = 0.7 top-p 0.9"
                    out.append((f"{pretty}, {name}", report))
            else:
                out.append((f"{label}, {name}", document))
    order = {h: i for i, h in enumerate(f"{k}, {n}" for k in ("greedy", "T = 1", "T = 0.7 top-p 0.9", "eager, greedy")
                                         for _, n in SETS)}
    return sorted(out, key=lambda column: order[column[0]])


def _method(table: dict, plain: str) -> tuple[str, dict] | None:
    """The table's entry for `plain` under either candidate scheme (`eagle2` or `eagle2@sampled`)."""
    for name, figures in table.items():
        if name.partition("@")[0] == plain:
            return name, figures
    return None


def _speedup(table: dict, plain: str) -> float | None:
    found = _method(table, plain)
    return found[1]["speedup_vs_ar"] if found else None


def pass_rates(report: dict, method: str) -> list[float]:
    """`method`'s tokens per second in each pass; derived for reports written before they carried
    `tokens_per_s_by_pass`: pass 0 from the per-prompt figures (one batch counted once), the others
    from the totals less pass 0."""
    figures = report["methods"][method]
    if figures.get("tokens_per_s_by_pass"):
        return figures["tokens_per_s_by_pass"]
    first = {}
    for prompt in report["per_prompt"]:
        entry = prompt["methods"].get(method)
        if entry is not None:
            first[tuple(entry["batch"])] = (entry["new_tokens"], entry["total_ms"])
    tokens, ms = sum(t for t, _ in first.values()), sum(m for _, m in first.values())
    passes = figures.get("repeats") or 1
    if not ms or passes < 2:
        return [figures["tokens_per_s"]]
    total_ms = 1000.0 * figures["new_tokens"] / figures["tokens_per_s"]
    rest = figures["new_tokens"] - tokens
    return [1000.0 * tokens / ms, 1000.0 * rest / (total_ms - ms)]


def pass_spread(report: dict) -> float | None:
    """The median over the report's measured methods of how far a method's speedup over `ar` moves
    from the first pass to the second (|s_1 / s_0 - 1|): the noise of one ratio in that table (the
    machine's own drift between passes, which moves every method alike, cancels). None with one pass."""
    if "ar" not in report["methods"] or not report["per_prompt"]:
        return None
    ar = pass_rates(report, "ar")
    moves = []
    for method in report["methods"]:
        if method == "ar" or method not in report["per_prompt"][0]["methods"]:  # not measured itself
            continue
        rates = pass_rates(report, method)
        if len(rates) > 1 and len(ar) > 1 and min(rates[0], ar[0], ar[1]) > 0:
            moves.append(abs((rates[1] / ar[1]) / (rates[0] / ar[0]) - 1.0))
    return float(sorted(moves)[len(moves) // 2]) if moves else None


def rows(report: dict) -> dict[str, str]:
    table = report["methods"]
    fmt = lambda value: f"{value:.2f}x" if value is not None else "-"
    ratio = lambda a, b: f"{a / b:.2f}" if a and b else "-"
    moe, best, tuned = _speedup(table, "moe-aware"), _speedup(table, "static-best"), _speedup(table, "static-tuned")
    eagle = _speedup(table, "eagle2")
    chains = {n: f["speedup_vs_ar"] for n, f in table.items() if n.startswith("chain:")}
    best_chain = max(chains, key=chains.get) if chains else None
    worst = min(((c, t["moe-aware"]["speedup_vs_ar"]) for c, t in report["per_class"].items() if "moe-aware" in t),
                key=lambda item: item[1], default=None)
    budget = table.get("static-best", {}).get("budget", "")
    budgets = table.get("static-tuned", {}).get("budgets") or {}
    mine = table.get("moe-aware", {})
    return {
        "eagle2 (60 nodes; `@sampled` when sampling)": fmt(eagle),
        "static-best (in hindsight)": f"{fmt(best)} ({budget.replace('@sampled', '')})" if best else "-",
        "static-tuned (chosen on the other prompts)": f"{fmt(tuned)} ({', '.join(b.replace('@sampled', '') for b in sorted(budgets, key=budgets.get, reverse=True))})" if tuned else "-",
        "best chain (sampled)": f"{fmt(chains[best_chain])} ({best_chain.partition('@')[0]})" if best_chain else "-",
        "truncate (EVICT-style)": fmt(_speedup(table, "truncate")),
        "**moe-aware**": f"**{fmt(moe)}**",
        "moe-aware, no expert pricing": fmt(_speedup(table, "moe-aware-noexperts")),
        "moe-aware / static-best": ratio(moe, best),
        "moe-aware / static-tuned": ratio(moe, tuned),
        "moe-aware / eagle2": ratio(moe, eagle),
        "moe-aware, worst class": f"{worst[1]:.2f}x ({worst[0]})" if worst else "-",
        "moe-aware, plan share / plain steps": (f"{mine['plan_share']:.1%} / {mine['plain_share']:.0%}"
                                                if mine.get("plan_share") is not None else "-"),
        "passes; median move of a speedup between passes": f"{mine.get('repeats', '-')}; "
                                                          + (f"{spread:.1%}" if (spread := pass_spread(report)) is not None else "-"),
    }


ACCEPT_SIZES = (4, 8, 60)


def accept_rows(results: Path) -> list[str]:
    """Markdown rows: per sampling report, the mean accepted length of `static:N@top` and
    `static:N@sampled` (N = 60: `eagle2@...`, EAGLE-2's budget) and the sampled scheme's gain."""
    out = []
    for heading, report in columns(results):
        table = report["methods"]
        cells = []
        for size in ACCEPT_SIZES:
            names = [f"static:{size}@{scheme}" for scheme in ("top", "sampled")]
            if size == 60:
                names = [name if name in table else f"eagle2@{name.partition('@')[2]}" for name in names]
            if all(name in table for name in names):
                top, sampled = (table[name]["mean_accept_len"] for name in names)
                cells.append(f"{top:.2f} / {sampled:.2f} ({sampled / top - 1:+.0%})")
            else:
                cells.append("-")
        if any(cell != "-" for cell in cells):
            out.append(f"| {heading} | " + " | ".join(cells) + " |")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=Path("analysis/results/controller"))
    parser.add_argument("--batch", action="store_true", help="the batch table (B = 4 and 16) instead")
    parser.add_argument("--accept", action="store_true",
                        help="accepted length of top-token against sampled candidates at 4, 8 and 60 nodes instead")
    args = parser.parse_args(argv)
    if args.accept:
        found = accept_rows(args.results)
        if not found:
            parser.error(f"no sampling report under {args.results} benched both candidate schemes")
        print("| accepted length, top / sampled candidates | " + " | ".join(f"{n} nodes" for n in ACCEPT_SIZES) + " |")
        print("|---" * (len(ACCEPT_SIZES) + 1) + "|")
        print("\n".join(found))
        return 0
    found = batch_columns(args.results) if args.batch else columns(args.results)
    if not found:
        parser.error(f"no bench reports under {args.results}")
    cells = [rows(report) for _, report in found]
    print("| speedup over ar | " + " | ".join(heading for heading, _ in found) + " |")
    print("|---" * (len(found) + 1) + "|")
    for name in cells[0]:
        print(f"| {name} | " + " | ".join(cell[name] for cell in cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
