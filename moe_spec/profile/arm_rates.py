"""Each way of drafting that `moe-aware`'s bound chooses among, measured on the profile's prompts:
the prior its bandit starts from (`moe_spec.policy.budget_bandit`).

An entry holds, for one sampling setting and one batch size, each arm's rate (tokens made over
milliseconds spent on the steps it decided, each until the next step's start), how many steps
measured it and the tokens a row made a step on them (how far an arm speculates: a tilted bandit
prices the arms the run has not judged by it, where the run finds the larger trees dearer or
cheaper than the profile did; empty in profiles made before it was kept), with every expert
resident or (`resident_experts`) with the experts offloaded behind a cache of that many per layer.
The rates are those of the machine and experts implementation profiled; the bandit carries over
their ratios, not their level.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from moe_spec.core.sampling import SamplingConfig


@dataclass(frozen=True)
class ArmRates:
    sampling: SamplingConfig
    rows: int  # the batch's rows
    rates: dict[str, float]  # arm -> tokens per ms
    steps: dict[str, int]  # arm -> steps that measured it
    resident_experts: int | None = None  # None: every expert resident; else offloaded behind a cache of C per layer
    tokens: dict[str, float] = field(default_factory=dict)  # arm -> tokens a row made a step ({}: not kept)

    def __post_init__(self):
        if self.rows < 1:
            raise ValueError(f"arm rates need at least one row, got {self.rows}")
        if self.resident_experts is not None and self.resident_experts < 0:
            raise ValueError(f"resident_experts must be None or >= 0, got {self.resident_experts}")
        bad = {arm: rate for arm, rate in self.rates.items() if not (math.isfinite(rate) and rate > 0)}
        if bad:
            raise ValueError(f"arm rates must be positive and finite, got {bad}")
        if set(self.steps) != set(self.rates) or any(n < 1 for n in self.steps.values()):
            raise ValueError("every arm's rate needs the positive number of steps that measured it")
        if self.tokens and (set(self.tokens) != set(self.rates)
                            or not all(math.isfinite(t) and t >= 1 for t in self.tokens.values())):
            raise ValueError(f"arm tokens must be given for every arm with a rate, each at least 1 a step, "
                             f"got {self.tokens}")

    def to_dict(self) -> dict:
        s = self.sampling
        return {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "rows": self.rows,
                "rates": dict(self.rates), "steps": dict(self.steps), "resident_experts": self.resident_experts,
                "tokens": dict(self.tokens)}

    @staticmethod
    def from_dict(data: dict) -> "ArmRates":
        sampling = SamplingConfig(temperature=float(data["temperature"]), top_k=int(data["top_k"]), top_p=float(data["top_p"]))
        resident = data.get("resident_experts")
        return ArmRates(sampling, int(data["rows"]), {str(k): float(v) for k, v in data["rates"].items()},
                        {str(k): int(v) for k, v in data["steps"].items()}, None if resident is None else int(resident),
                        {str(k): float(v) for k, v in data.get("tokens", {}).items()})
