"""The drafter table of docs/drafters.md from `moe-spec bench` results: for each drafter, setting and
prompt set, the mean accepted length under EAGLE-2's 60-node tree, `static-best` and `moe-aware`
(speedup over `ar` and accepted length) and their ratio.

    python scripts/drafter_table.py --results analysis/results/drafters

Reads RESULTS/{drafter}_{setting}_{set}.json (as scripts/drafter_benches.sh writes them).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

DRAFTERS = (("eagle3", "EAGLE-3 head (`default`)"), ("mtp", "MTP layer (`mtp`)"),
            ("draft_model", "draft model (`default_draft_model`)"), ("lookup", "lookup (`lookup`)"))
SETTINGS = (("greedy", "greedy"), ("t1", "T = 1"))
SETS = (("shipped", "shipped"), ("foreign", "held-out"))


def _method(methods: dict, *names: str) -> dict | None:
    return next((methods[n] for n in names if n in methods), None)


def rows(results: Path) -> list[str]:
    out = ["| drafter | setting | prompts | accepted, EAGLE-2 tree | static-best | moe-aware | moe-aware / static-best |",
           "|---|---|---|---|---|---|---|"]
    for key, label in DRAFTERS:
        for setting, setting_label in SETTINGS:
            for prompt_set, set_label in SETS:
                path = results / f"{key}_{setting}_{prompt_set}.json"
                if not path.is_file():
                    continue
                methods = json.loads(path.read_text())["methods"]
                eagle2 = _method(methods, "eagle2", "eagle2@sampled")
                best = _method(methods, "static-best", "static-best@sampled")
                aware = methods["moe-aware"]
                ratio = aware["tokens_per_s"] / best["tokens_per_s"]
                out.append(f"| {label} | {setting_label} | {set_label} | {eagle2['mean_accept_len']:.2f} | "
                           f"{best['speedup_vs_ar']:.2f}x ({best.get('budget', '?')}, {best['mean_accept_len']:.2f}) | "
                           f"{aware['speedup_vs_ar']:.2f}x ({aware['mean_accept_len']:.2f}) | {ratio:.2f} |")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=Path("analysis/results/drafters"))
    args = parser.parse_args(argv)
    print("\n".join(rows(args.results)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
