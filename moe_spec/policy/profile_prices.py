"""`ProfilePrices`: the profile's own (unscaled) prices of the passes the sizing compares on every
step, each shape computed once: a plain pass of B rows, B chains of L nodes, the unique-experts
curve at a tree size, and a cost model with a tree's expected experts folded into its token price.
The controller scales them by the machine's measured speed (`CostCorrection`); these never change.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from moe_spec.profile.cost_model import CostModel


class ProfilePrices:
    """Cached predictions of `profile`'s cost model; `price_experts=False` (the ablation) prices tokens alone."""

    def __init__(self, profile, price_experts: bool = True):
        self.profile = profile
        self.price_experts = price_experts
        self._curve: dict[int, np.ndarray] = {}  # tokens -> [L] the unique-experts curve there
        self._chains: dict[tuple[int, int], float] = {}  # (nodes, rows) -> verify ms of such chains
        self._plain: dict[int, float] = {}  # rows -> a plain pass of that many rows

    def curve_at(self, tokens: int) -> np.ndarray:
        """[L] the profile's unique-experts curve of real trees at `tokens` tokens."""
        if tokens not in self._curve:
            self._curve[tokens] = self.profile.unique_experts_curve.real_at(tokens)
        return self._curve[tokens]

    def plain_pass_ms(self, rows: int) -> float:
        """A plain pass of `rows` rows: B rows make B tokens, whose B roots load about
        E (1 - (1 - K/E)^B) experts per layer (distinct rows route like unrelated tokens; one row
        loads exactly K)."""
        if rows not in self._plain:
            cost = self.profile.cost_model
            if not cost.num_layers:
                self._plain[rows] = cost.predict_ms(rows, [], rows=rows)
            else:
                top_k, experts = float(self.profile.top_k), float(self.profile.num_experts)
                unique = experts * (1.0 - (1.0 - top_k / experts) ** rows)
                self._plain[rows] = cost.predict_ms(rows, [unique] * cost.num_layers, rows=rows)
        return self._plain[rows]

    def chain_verify_ms(self, length: int, rows: int) -> float:
        """Verify time of `rows` chains of `length` nodes and their roots: each row's L + 1 tokens
        load the unique-experts curve U(L + 1) per layer, the rows together E (1 - (1 - U / E)^B);
        tokens alone when experts are not priced or the profile has no curve (fetches of offloaded
        experts are not priced here: the controller's cost correction learns their average)."""
        key = (length, rows)
        if key not in self._chains:
            cost = self.profile.cost_model
            tokens = rows * (length + 1)
            if not (self.price_experts and cost.num_layers and self.profile.unique_experts_curve is not None):
                self._chains[key] = cost.fixed_ms(rows) + cost.per_token_ms * tokens
            else:
                experts = float(self.profile.num_experts)
                unique = experts * (1.0 - (1.0 - self.curve_at(length + 1) / experts) ** rows)  # [L]
                self._chains[key] = cost.predict_ms(tokens, unique, rows=rows)
        return self._chains[key]

    def with_expected_experts(self, cost: CostModel, drafted: int) -> CostModel:
        """`cost` with the experts a one-row tree of `drafted` nodes loads on average (the
        unique-experts curve U(T) per layer) folded into its token price, so that pricing tokens
        alone prices those experts: the whole tree and its root cost exactly `cost` at
        U(drafted + 1), and each drafted node its share of U(drafted + 1) - U(1)."""
        weights = cost.expert_weights()  # [L] ms per unique expert at the speed `cost` holds
        root = float(weights @ self.curve_at(1))  # ms of the experts the root alone loads
        extra = (float(weights @ self.curve_at(drafted + 1)) - root) / drafted  # ms per drafted node
        return replace(cost, base_ms=cost.base_ms + root - extra, per_token_ms=cost.per_token_ms + extra)
