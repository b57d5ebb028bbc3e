"""`moe-spec bench` with `moe-aware`'s bound held to one of its arms (`plain`, `sized`, `static:N`,
`chain:N`): what that arm costs inside the bound (its plan, its bookkeeping), side by side with the
method it stands for.

    python scripts/force_arm.py plain -- --config configs/bench_offload.yaml --temperature 1 --methods ar,moe-aware --repeats 2

Everything after `--` is `moe-spec bench`'s own options; the report and its final JSON line are
the bench's.
"""

from __future__ import annotations

import sys
from dataclasses import replace

from moe_spec.cli import main as cli
from moe_spec.policy import registry
from moe_spec.policy.bounded_controller import FIXED_ARMS, PLAIN, SIZED, BoundedController
from moe_spec.policy.budget_bandit import BudgetBandit


def held_to(arm: str) -> registry.Policy:
    """`moe-aware`'s policy, its bound's bandit holding `arm` alone."""
    policy = registry.METHODS["moe-aware"]

    def build(*args, **kwargs):
        controller = policy.build(*args, **kwargs)
        if not isinstance(controller, BoundedController):  # a replay: no bound to hold
            return controller
        return BoundedController(controller.sizing, bandit=BudgetBandit((arm,)))
    return replace(policy, build=build)


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[1] != "--":
        raise SystemExit(__doc__)
    arms = (SIZED, PLAIN, *(f"{shape}:{n}" for shape in ("static", "chain") for n in FIXED_ARMS))
    if argv[0] not in arms:
        raise SystemExit(f"force_arm.py: unknown arm {argv[0]!r}; the bound's arms are {', '.join(arms)}")
    original = registry.METHODS["moe-aware"]
    registry.METHODS["moe-aware"] = held_to(argv[0])
    try:
        return cli.main(["bench", *argv[2:]])
    finally:
        registry.METHODS["moe-aware"] = original


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
