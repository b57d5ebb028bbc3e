"""`moe-spec bench` with one more method beside the registry's: `moe-aware-unbounded-profilefetch`,
the sizing alone (its own gate, as `moe-aware-unbounded`) pricing reads at the profile's fetch cost
instead of at what the run measures them to cost. Side by side with `moe-aware-unbounded`, it shows
what learning the price of reads does to the sizing itself, without the bound's choice among arms.

    python scripts/fetch_price_ab.py --config configs/bench_offload.yaml --limit 2 \\
        --methods ar,static:1,static:2,moe-aware-unbounded,moe-aware-unbounded-profilefetch,moe-aware,moe-aware-profilefetch \\
        --repeats 2 --json analysis/results/offload/fetch_correction/ab_off16_shipped.json

Every argument is `moe-spec bench`'s.
"""

from __future__ import annotations

import sys

from moe_spec.cli.main import main as cli
from moe_spec.policy import registry

SIZING_AT_PROFILE_PRICE = "moe-aware-unbounded-profilefetch"


def main(argv: list[str] | None = None) -> int:
    """Bench with the method registered for this call only (the registry is left as it was)."""
    registry.METHODS[SIZING_AT_PROFILE_PRICE] = registry.Policy(
        True, registry.moe_aware_builder(bounded=False, learn_fetch=False))
    try:
        return cli(["bench", *(sys.argv[1:] if argv is None else argv)])
    finally:
        del registry.METHODS[SIZING_AT_PROFILE_PRICE]


if __name__ == "__main__":
    sys.exit(main())
