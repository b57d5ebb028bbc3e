"""The profile's verify price against a bench's measured passes, method by method.

    python scripts/price_check.py PROFILE_JSON BENCH_JSON [--json OUT] [--sweep-model]

`BENCH_JSON` is a one-row, not offloaded `moe-spec bench --json` report (e.g. one of
`scripts/controller_regimes.sh`'s greedy reports). Prints priced / measured per method and a final
JSON line; see `moe_spec.experiments.price_check`. `--sweep-model` prices with the latency sweep's
model before the profile mapped it onto the loop's passes (`moe_spec.profile.loop_alignment`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moe_spec.experiments.price_check import price_checks
from moe_spec.profile.cost_model import CostModel


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("profile", help="a profile JSON")
    parser.add_argument("bench", help="a one-row bench report (moe-spec bench --json)")
    parser.add_argument("--json", default=None, help="write the rows here too")
    parser.add_argument("--sweep-model", action="store_true", help="price with the sweep's model, not the profile's own")
    args = parser.parse_args(argv)
    document = json.loads(Path(args.profile).read_text())
    section = document["cost_model"]
    if args.sweep_model:
        loop = document.get("details", {}).get("cost_model_report", {}).get("loop_alignment")
        if loop is None:
            print(f"{args.profile}: no loop alignment, so its cost model is the sweep's", file=sys.stderr)
            return 2
        section = loop["sweep_model"]
    model = CostModel.from_dict(section)
    report = json.loads(Path(args.bench).read_text())
    config = report.get("config", {})
    if int(config.get("batch_size", 1) or 1) != 1 or config.get("offload"):
        print(f"{args.bench}: a batched or offloaded bench; its passes hold work the profile does not price",
              file=sys.stderr)
        return 2
    checks = price_checks(model, report["methods"])
    print(f"{'method':22s} {'tokens':>6s} {'U/layer':>7s} {'measured ms':>11s} {'priced ms':>9s} {'priced/measured':>15s}")
    for check in checks:
        print(f"{check.method:22s} {check.tokens:6.1f} {check.unique_experts:7.1f} {check.measured_ms:11.2f} "
              f"{check.priced_ms:9.2f} {check.ratio:15.2f}")
    rows = [check.to_dict() for check in checks]
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    print(json.dumps({"command": "price_check", "profile": args.profile, "bench": args.bench, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
