"""The folder `scripts/vllm_bench.py` runs on (`moe_spec.testing.vllm_world.build_world`): the engine
tests' tiny Qwen3-MoE target, an EAGLE-3 head trained for it by `train_draft` (60 steps), prompts, a
profile of the pair, and exports of the head with moe_spec's schedule, priced by the profile
(`export/`) and by vLLM's own step times (`export_engine/`, `--engine-costs measure`: one engine per
K, in vLLM's environment, timed at each of `--batch-sizes`).

    python scripts/vllm_tiny_world.py --out runs/vllm_tiny [--prompts 16] [--max-k 3] [--batch-sizes 1,4,16]

Ends with one JSON line: each export's K per batch size.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moe_spec.testing.vllm_world import build_world

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-k", type=int, default=3)
    parser.add_argument("--batch-sizes", default="1,4,16", help="what the engine-priced export times vLLM at")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    if not VLLM_PYTHON.is_file():
        print(f"vllm_tiny_world: {VLLM_PYTHON} is missing; `make vllm-env` makes it", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    build_world(args.out, VLLM_PYTHON, prompts=args.prompts, max_k=args.max_k, max_batch=max(sizes),
                new_tokens=args.max_new_tokens, engine_max_k=args.max_k, engine_batch_sizes=args.batch_sizes)
    schedules = {name: json.loads((args.out / name / "speculative_config.json").read_text())
                 .get("num_speculative_tokens_per_batch_size") for name in ("export", "export_engine")}
    print(json.dumps({"command": "vllm_tiny_world", "out": str(args.out), "schedules": schedules}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
