"""Fuzz the inputs of `SpecDecoder.generate` and the drop-in on a tiny Qwen3-MoE; print the count of
combinations and every distinct refusal message (see `moe_spec.testing.input_fuzz`).

    python scripts/fuzz_inputs.py [--engine-cases 1200] [--drop-in-cases 400] [--seed 0]

Exits 1 if any combination failed (another exception type, a message naming no bad parameter, a
bad value decoded anyway, or a wrong result).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from moe_spec.testing.input_fuzz import DropInFuzz, EngineFuzz, engine_decoders, summary
from moe_spec.testing.tiny_models import tiny_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine-cases", type=int, default=1200)
    parser.add_argument("--drop-in-cases", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model = tiny_model("qwen3_moe")
    start = time.perf_counter()
    engine = EngineFuzz(model, engine_decoders(model), args.seed).run(args.engine_cases)
    drop_in = DropInFuzz(model, args.seed).run(args.drop_in_cases)
    seconds = time.perf_counter() - start
    for name, outcome in (("SpecDecoder.generate", engine), ("drop-in speculative_generate", drop_in)):
        print(f"== {name}\n{summary(outcome)}\n")
    print(json.dumps({"combinations": engine.cases + drop_in.cases, "engine": engine.cases, "drop_in": drop_in.cases,
                      "decoded": engine.decoded + drop_in.decoded,
                      "distinct_messages": len(set(engine.refused) | set(drop_in.refused)),
                      "failures": len(engine.failures) + len(drop_in.failures), "seconds": round(seconds, 1)}))
    return 1 if engine.failures or drop_in.failures else 0


if __name__ == "__main__":
    sys.exit(main())
