"""The controller's own time inside decoding: `plan` and `observe` of a method, per step and as a share.

    python scripts/controller_time.py [--method moe-aware] [--batch-size 1] [--prompts configs/bench/batch.jsonl]
                                      [--limit 16] [--max-new-tokens 32] [--threads 1]

Decodes the first `--limit` prompts of the file in left-padded batches of `--batch-size` with the
embedded pair and the shipped profile, and times every call of the controller's `plan` (what the
bench's `plan %` counts, less the engine's own checks) and `observe` (after the step, outside the
bench's figure) where they run: between the drafter's and the target's forwards, whose work
evicts the controller's working set from the caches (the same calls replayed back to back run two
to three times faster). A short warm-up request runs first. Prints the means per step in
microseconds, their share of the decoding time and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from moe_spec.core.engine import SpecDecoder
from moe_spec.core.target import TargetModel
from moe_spec.experiments.prompt_file import load_prompts
from moe_spec.experiments.runner import left_pad
from moe_spec.loading import load_drafter, load_target, load_tokenizer
from moe_spec.policy.registry import MethodContext, build_method
from moe_spec.profile.artifact import Profile

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="moe-aware")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--prompts", default=str(ROOT / "configs/bench/batch.jsonl"))
    parser.add_argument("--limit", type=int, default=16, help="prompts decoded, from the top of the file")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    for name in ("batch_size", "limit", "max_new_tokens", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    torch.set_num_threads(args.threads)
    target, tokenizer = TargetModel(load_target()), load_tokenizer()
    context = MethodContext(target, lambda: load_drafter("default", target),
                            lambda: Profile.load(ROOT / "moe_spec/assets/default_profile.json"))
    method = build_method(args.method, context)
    if method.controller is None:
        parser.error(f"--method {args.method} has no controller to time")
    prompts = [p.input_ids(tokenizer) for p in load_prompts(args.prompts)][:args.limit]
    decoder = SpecDecoder(target, drafter=method.drafter, controller=method.controller)
    ids, mask = left_pad(prompts[:args.batch_size], 0)
    decoder.generate(ids, attention_mask=mask, max_new_tokens=8)  # warm-up, not timed

    spent = {"plan": 0.0, "observe": 0.0}
    calls = {"plan": 0, "observe": 0}
    controller = method.controller
    for name in spent:
        _timed(controller, name, spent, calls)
    start = time.perf_counter()
    for first in range(0, len(prompts), args.batch_size):
        ids, mask = left_pad(prompts[first:first + args.batch_size], 0)
        decoder.generate(ids, attention_mask=mask, max_new_tokens=args.max_new_tokens)
    total = time.perf_counter() - start
    steps = max(calls["plan"], 1)
    report = {
        "method": args.method, "batch_size": args.batch_size, "prompts": len(prompts), "steps": calls["plan"],
        "plan_us": round(spent["plan"] / steps * 1e6, 1), "observe_us": round(spent["observe"] / steps * 1e6, 1),
        "plan_share": round(spent["plan"] / total, 4), "controller_share": round(sum(spent.values()) / total, 4),
    }
    print(f"{args.method} at B = {args.batch_size}, {report['steps']} steps: plan {report['plan_us']} us, "
          f"observe {report['observe_us']} us a step; {report['plan_share']:.1%} of decoding in plan, "
          f"{report['controller_share']:.1%} in plan and observe")
    print(json.dumps(report))
    return 0


def _timed(controller, name: str, spent: dict, calls: dict) -> None:
    """Wrap the controller's method `name` so that every call adds its time to `spent[name]`."""
    inner = getattr(controller, name)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - start
            calls[name] += 1

    setattr(controller, name, timed)


if __name__ == "__main__":
    raise SystemExit(main())
