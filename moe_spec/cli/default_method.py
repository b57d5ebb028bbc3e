"""The method `generate` and `demo` decode with when none is named: the best this target and
machine allow.

`moe-aware` where a profile of the target and drafter exists (`--profile`, the embedded pair's
shipped profile, or the one `moe-spec profile` cached for them); else `FALLBACK_METHOD`, the best
fixed tree measured so far, with a hint on stderr on how to make the profile.
"""

from __future__ import annotations

import sys
from pathlib import Path

from moe_spec.core.target import TargetModel
from moe_spec.measure.store import existing_profile_path
from moe_spec.policy.registry import FALLBACK_METHOD


def profile_path(model: str | None, drafter: str, profile: str | None, target: TargetModel) -> Path | None:
    """--profile; else the embedded pair's shipped profile; else the one `moe-spec profile` cached for
    this target and drafter; else None."""
    if profile is not None:
        return Path(profile)
    return existing_profile_path(target, drafter)


def default_method(command: str, model: str | None, drafter: str, profile: Path | None) -> str:
    """`ar` without a drafter, `moe-aware` with a profile, else `FALLBACK_METHOD` and the hint."""
    if drafter == "none":
        return "ar"
    if profile is not None:
        return "moe-aware"
    print(f"moe-spec {command}: no profile of this target and drafter on this machine, so decoding with "
          f"{FALLBACK_METHOD} (the best fixed tree measured so far) rather than the cost-aware `moe-aware`; "
          f"`moe-spec profile --model {model or '<model>'} --drafter {drafter} --prompts <prompts.jsonl> "
          f"--out <profile.json>` makes one (a few minutes on a CPU for a small model) and keeps it where "
          f"{command} finds it", file=sys.stderr)
    return FALLBACK_METHOD
