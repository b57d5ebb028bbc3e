"""Offline vLLM throughput with and without moe_spec's exported schedule, side by side in one run.

    python scripts/vllm_bench.py --model TARGET --export runs/vllm --prompts prompts.jsonl \
        [--batch-sizes 1,4,16] [--k 3] [--max-tokens 32] [--repeats 2] [--json OUT.json]

For each batch size B (prompts submitted B at a time), one engine per configuration: no speculation,
a fixed K (`--k`) with the exported head, and the exported schedule (`speculative_config.json`, its K
chosen per batch size by moe_spec's cost model), and with `--export-engine` a second export's schedule
(priced by vLLM's own step costs, `export-vllm --engine-costs measure`). Prints tokens per second of each and vLLM's acceptance
(accepted draft tokens per draft, per position), then one JSON line. Engines run in vLLM's own
environment (`make vllm-env`) through `moe_spec/integrations/vllm/engine_run.py`; prompts are token ids
(`prompt_ids` in the JSON-lines file). On a CPU the figures are functional evidence; the same command is
what a GPU user runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moe_spec.integrations.vllm.engine_run import launch

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--export", type=Path, required=True, help="the folder `moe-spec export-vllm` wrote")
    parser.add_argument("--prompts", type=Path, required=True, help="JSON lines with prompt_ids")
    parser.add_argument("--batch-sizes", default="1,4,16")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--export-engine", type=Path, default=None,
                        help="a second export, its schedule priced by vLLM's own step costs (`--engine-costs`), "
                             "run beside the first")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if not VLLM_PYTHON.is_file():
        print(f"vllm_bench: {VLLM_PYTHON} is missing; `make vllm-env` makes it", file=sys.stderr)
        return 2
    prompts = [json.loads(line)["prompt_ids"] for line in args.prompts.read_text().splitlines() if line.strip()]
    exported = json.loads((args.export / "speculative_config.json").read_text())
    fixed = {"method": exported["method"], "num_speculative_tokens": args.k,
             **({"model": exported["model"]} if "model" in exported else {})}
    configurations = [("no speculation", None), (f"K = {args.k}", fixed), ("moe_spec schedule", exported)]
    engine_priced = None
    if args.export_engine is not None:
        engine_priced = json.loads((args.export_engine / "speculative_config.json").read_text())
        configurations.append(("vLLM-priced schedule", engine_priced))
    runs = []
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        for name, config in configurations:
            runs.append({"name": f"{name}, B = {batch}", "batch_size": batch, "repeats": args.repeats,
                         "speculative_config": config})
    job = {"model": args.model, "dtype": "float32", "prompts": prompts, "max_tokens": args.max_tokens,
           "max_model_len": max(len(p) for p in prompts) + args.max_tokens + 8, "runs": runs}
    try:
        result = launch(job, str(VLLM_PYTHON), str(ROOT))
    except RuntimeError as error:
        print(error, file=sys.stderr)
        return 1
    rows = []
    print(f"{'configuration':<28} {'tok/s':>8} {'vs none':>8} {'K drafted':>9} {'accepted/draft':>14}  per position")
    plain = {}
    for run in result["runs"]:
        tokens = len(prompts) * args.max_tokens
        rate = tokens * len(run["seconds"]) / sum(run["seconds"])
        spec = run["spec"]
        batch = run["batch_size"]
        plain.setdefault(batch, rate)
        drafts = spec.get("num_drafts", 0)
        per_draft = spec.get("num_draft_tokens", 0) / drafts if drafts else 0.0
        accepted = spec.get("num_accepted_tokens", 0) / drafts if drafts else 0.0
        rows.append({"name": run["name"], "batch_size": batch, "tokens_per_s": round(rate, 2),
                     "vs_no_speculation": round(rate / plain[batch], 3), "draft_tokens_per_draft": round(per_draft, 3),
                     "accepted_per_draft": round(accepted, 3), "accepted_per_position": spec.get("num_accepted_tokens_per_pos"),
                     "seconds": run["seconds"]})
        print(f"{run['name']:<28} {rate:>8.1f} {rate / plain[batch]:>7.2f}x {per_draft:>9.2f} {accepted:>14.2f}  "
              f"{spec.get('num_accepted_tokens_per_pos', '-')}")
    summary = {"command": "vllm_bench", "model": args.model, "export": str(args.export), "rows": rows,
               "schedule": exported.get("num_speculative_tokens_per_batch_size"),
               "engine_priced_schedule": (engine_priced or {}).get("num_speculative_tokens_per_batch_size")}
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
