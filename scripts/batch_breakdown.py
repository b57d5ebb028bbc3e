"""Where batched decoding's time goes, per method: the steps where every row is still decoding,
the steps after some rows finished, and the prefill; for `moe-aware` also how its model's
predictions on the full-batch steps compare with what they produced and took.

    python scripts/batch_breakdown.py --prompts configs/bench/batch.jsonl --batch-size 16 [--passes 4]

Methods ar, static:1, static:2 and moe-aware on the embedded pair, interleaved (the order rotates
every batch and pass; the first pass warms up and is not counted). Prints a line per method and,
last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

import torch

from moe_spec.core.drafting import TreeBudget
from moe_spec.core.engine import SpecDecoder
from moe_spec.core.target import TargetModel
from moe_spec.experiments.prompt_file import load_prompts
from moe_spec.experiments.runner import left_pad
from moe_spec.loading import load_drafter, load_target, load_tokenizer
from moe_spec.measure.store import DEFAULT_PROFILE
from moe_spec.policy.moe_aware import MoeAwareController
from moe_spec.policy.static import StaticController
from moe_spec.profile.artifact import Profile

METHODS = ("ar", "static:1", "static:2", "moe-aware")


@dataclass
class Split:
    """One method's time and tokens, by kind of step."""

    full_ms: float = 0.0  # steps with every row of the batch still decoding
    full_tokens: int = 0
    tail_ms: float = 0.0  # steps after some rows finished
    tail_tokens: int = 0
    prefill_ms: float = 0.0
    total_ms: float = 0.0
    tokens: int = 0
    steps: int = 0
    plain_steps: int = 0
    # moe-aware's full-batch speculative steps: its model's expected tokens and verify ms against the measured
    predicted_tokens: float = 0.0
    produced_tokens: int = 0
    predicted_verify_ms: float = 0.0
    measured_verify_ms: float = 0.0
    checked_steps: int = 0

    def summary(self) -> dict:
        rate = lambda tokens, ms: round(1000.0 * tokens / ms, 1) if ms else None
        out = {"tokens_per_s": rate(self.tokens, self.total_ms),
               "full_batch_tokens_per_s": rate(self.full_tokens, self.full_ms),
               "full_batch_share": round(self.full_ms / self.total_ms, 3),
               "tail_tokens_per_s": rate(self.tail_tokens, self.tail_ms),
               "tail_share": round(self.tail_ms / self.total_ms, 3),
               "prefill_share": round(self.prefill_ms / self.total_ms, 3),
               "plain_steps": round(self.plain_steps / max(self.steps, 1), 3)}
        if self.checked_steps:
            out.update(checked_steps=self.checked_steps, predicted_tokens=round(self.predicted_tokens, 1),
                       produced_tokens=self.produced_tokens, predicted_verify_ms=round(self.predicted_verify_ms, 1),
                       measured_verify_ms=round(self.measured_verify_ms, 1))
        return out


def _checking(controller: MoeAwareController, split: Split, rows: int) -> MoeAwareController:
    """`controller`, its observe first adding its full-batch steps' predictions to `split`: the
    values it verified (online correction applied) and the verify time it predicted at the speed
    it had measured."""
    observe = controller.observe

    def checked(record):
        plan = controller._verify_plan
        if record.speculated and record.verified.rows == rows and plan is not None and plan.predicted_ms is not None:
            values = controller.values_of(record.verified)
            split.predicted_tokens += sum(float(v[1:].sum()) for v in values) + rows
            split.produced_tokens += record.tokens_produced
            base, scaled = controller.profile.cost_model, controller.cost_model()
            split.predicted_verify_ms += ((plan.predicted_ms - base.fixed_ms(rows)) * controller.cost_correction.scale
                                          + scaled.fixed_ms(rows))
            split.measured_verify_ms += record.verify_ms
            split.checked_steps += 1
        observe(record)

    controller.observe = checked
    return controller


def breakdown(target: TargetModel, drafter, profile: Profile, prompts: list[torch.Tensor], batch_size: int,
              max_new_tokens: int, passes: int) -> dict[str, Split]:
    """Every method over the prompts in batches of `batch_size`, `passes` times (the first not counted)."""
    if passes < 2:
        raise ValueError(f"passes must be at least 2 (the first warms up), got {passes}")
    groups = [prompts[i:i + batch_size] for i in range(0, len(prompts), batch_size)]
    splits = {name: Split() for name in METHODS}
    for repeat in range(passes):
        for index, group in enumerate(groups):
            shift = (repeat + index) % len(METHODS)
            for name in METHODS[shift:] + METHODS[:shift]:
                split = splits[name] if repeat else Split()
                if name == "ar":
                    decoder = SpecDecoder(target)
                elif name == "moe-aware":
                    decoder = SpecDecoder(target, drafter=drafter,
                                          controller=_checking(MoeAwareController(profile), split, len(group)))
                else:
                    decoder = SpecDecoder(target, drafter=drafter,
                                          controller=StaticController(TreeBudget(int(name.partition(":")[2]))))
                ids, mask = left_pad(group, 0)
                stats = decoder.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens).stats
                split.prefill_ms += stats.prefill_ms
                split.total_ms += stats.total_ms
                split.tokens += stats.new_tokens
                for step in stats.steps:
                    ms = step.draft_ms + step.plan_ms + step.verify_ms + step.overhead_ms
                    if step.rows == len(group):
                        split.full_ms, split.full_tokens = split.full_ms + ms, split.full_tokens + step.accepted_length
                    else:
                        split.tail_ms, split.tail_tokens = split.tail_ms + ms, split.tail_tokens + step.accepted_length
                    split.steps += 1
                    split.plain_steps += step.tree_size == 0
    return splits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", required=True, help="JSON-lines prompt file")
    parser.add_argument("--limit", type=int, default=16, help="prompts used, first in file order (default 16)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--passes", type=int, default=4, help="passes over the prompts, the first a warm-up (default 4)")
    parser.add_argument("--profile", default=str(DEFAULT_PROFILE))
    args = parser.parse_args(argv)
    for name in ("limit", "batch_size", "max_new_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    torch.set_num_threads(1)
    tokenizer = load_tokenizer()
    target = TargetModel(load_target())
    prompts = [p.input_ids(tokenizer) for p in load_prompts(args.prompts)][: args.limit]
    splits = breakdown(target, load_drafter("default", target), Profile.load(args.profile, target), prompts,
                       args.batch_size, args.max_new_tokens, args.passes)
    summaries = {name: split.summary() for name, split in splits.items()}
    for name, s in summaries.items():
        print(f"{name:9s} {s['tokens_per_s']:6.1f} tok/s | full-batch steps {s['full_batch_tokens_per_s']} tok/s, "
              f"{s['full_batch_share']:.0%} of the time | later steps {s['tail_tokens_per_s']} tok/s, "
              f"{s['tail_share']:.0%} | prefill {s['prefill_share']:.0%} | plain steps {s['plain_steps']:.0%}")
    mine = summaries["moe-aware"]
    if "checked_steps" in mine:
        print(f"moe-aware on {mine['checked_steps']} full-batch steps: expected {mine['predicted_tokens']} tokens, "
              f"produced {mine['produced_tokens']}; predicted verify {mine['predicted_verify_ms']} ms, "
              f"measured {mine['measured_verify_ms']}")
    print(json.dumps({"command": "batch_breakdown", "batch_size": args.batch_size, "prompts": args.prompts,
                      "passes": args.passes, "methods": summaries}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
