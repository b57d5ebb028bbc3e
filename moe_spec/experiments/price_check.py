"""The profile's verify price against the verify passes a bench measured in its own decoding loop.

The profile times passes in isolation (a prefilled cache, repeats, optionally caches evicted
before each); a controller prices the passes of the live loop. This compares the two on a bench
report: for each method, the cost model's price of a pass of the method's mean tokens and mean
unique experts per layer against the method's mean measured verify ms. The model is linear in both,
so the price of the means is the mean of the prices when the expert cost is shared by all layers
(with per-layer costs it uses the mean over layers, an approximation). One-row passes only: a
batched bench's passes add per-row work the profile does not price, and an offloaded one's fetches
are priced from the store, not the profile.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_spec.profile.cost_model import CostModel


@dataclass(frozen=True)
class PriceCheck:
    method: str
    tokens: float  # mean verified tokens a pass (drafted nodes + the root)
    unique_experts: float  # mean unique experts per layer a pass
    measured_ms: float
    priced_ms: float

    @property
    def ratio(self) -> float:
        """Priced over measured (> 1: the profile prices the pass dearer than the loop pays)."""
        return self.priced_ms / self.measured_ms

    def to_dict(self) -> dict:
        return {"method": self.method, "tokens": round(self.tokens, 2), "unique_experts": round(self.unique_experts, 2),
                "measured_ms": round(self.measured_ms, 3), "priced_ms": round(self.priced_ms, 3),
                "priced_over_measured": round(self.ratio, 4)}


def price_checks(model: CostModel, methods: dict[str, dict]) -> list[PriceCheck]:
    """One `PriceCheck` per method of a bench report's `methods` (its `mean_tree_size`,
    `unique_experts_per_layer` and `verify_ms`), skipping methods with no verify time."""
    checks = []
    for name, summary in methods.items():
        measured = summary.get("verify_ms")
        if not measured or measured <= 0:
            continue
        tokens = float(summary["mean_tree_size"]) + 1.0
        unique = float(summary["unique_experts_per_layer"])
        priced = model.predict_ms(tokens, [unique] * model.num_layers)
        checks.append(PriceCheck(name, tokens, unique, float(measured), priced))
    return checks
