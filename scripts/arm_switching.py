"""What switching between arms costs: `moe-aware`'s bound held to a fixed rota of two of its arms,
switching every `--block` steps, side by side with each arm's own method, in one `moe-spec bench`.

    python scripts/arm_switching.py plain static:1 --blocks 1,16 -- --config configs/bench_offload.yaml --resident-experts 8 --methods ar,static:1

A bound that alternates arms step by step pays what neither arm alone pays where the arms share
state: an offloaded cache that one arm fills with the experts its trees need and the other then
misses, a drafter that catches up on the tokens a plain step made. Each rota is registered as
`rota-<block>` (the bound with a bandit that plays the first arm for `block` steps, then the
second, and so on); with no switching cost a rota runs at the mean of the two arms' step times.
Everything after `--` is `moe-spec bench`'s own options (`--methods` gets the rotas added); the
report and its final JSON line are the bench's.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from moe_spec.cli import main as cli
from moe_spec.policy import registry
from moe_spec.policy.bounded_controller import FIXED_ARMS, PLAIN, SIZED, BoundedController
from moe_spec.policy.budget_bandit import BudgetBandit


class RotaBandit(BudgetBandit):
    """A bandit that ignores its evidence: it plays `arms` in turn, each for `block` choices."""

    def __init__(self, arms: tuple[str, ...], block: int):
        super().__init__(arms)
        self.block = block
        self._choices = 0

    def choose(self, key, allowed=None, in_flight=(), difficulty=None) -> str:
        arm = self.arms[(self._choices // self.block) % len(self.arms)]
        self._choices += 1
        return arm


def rota(arms: tuple[str, ...], block: int) -> registry.Policy:
    """`moe-aware`'s policy, its bound's bandit replaced by a `RotaBandit`."""
    policy = registry.METHODS["moe-aware"]

    def build(*args, **kwargs):
        controller = policy.build(*args, **kwargs)
        if not isinstance(controller, BoundedController):  # a replay: no bound to hold
            return controller
        return BoundedController(controller.sizing, bandit=RotaBandit(arms, block))
    return replace(policy, build=build)


def main(argv: list[str]) -> int:
    if "--" not in argv:
        raise SystemExit(__doc__)
    split = argv.index("--")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("arms", nargs=2, help="two of the bound's arms (plain, sized, static:N, chain:N)")
    parser.add_argument("--blocks", default="1,16", help="steps an arm plays before the other, comma-separated")
    args = parser.parse_args(argv[:split])
    known = (SIZED, PLAIN, *(f"{shape}:{n}" for shape in ("static", "chain") for n in FIXED_ARMS))
    unknown = [arm for arm in args.arms if arm not in known]
    if unknown:
        raise SystemExit(f"arm_switching.py: unknown arm {unknown[0]!r}; the bound's arms are {', '.join(known)}")
    blocks = [int(b) for b in args.blocks.split(",")]
    if any(b < 1 for b in blocks):
        raise SystemExit(f"arm_switching.py: --blocks must be positive step counts, got {args.blocks!r}")
    bench = argv[split + 1:]
    names = [f"rota-{b}" for b in blocks]
    if "--methods" in bench:
        at = bench.index("--methods") + 1
        bench[at] = ",".join([bench[at], *names])
    else:
        bench += ["--methods", ",".join(["ar", *names])]
    added = {name: rota(tuple(args.arms), block) for name, block in zip(names, blocks)}
    registry.METHODS.update(added)
    try:
        return cli.main(["bench", *bench])
    finally:
        for name in added:
            registry.METHODS.pop(name, None)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
