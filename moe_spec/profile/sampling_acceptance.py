"""Acceptance measured per sampling setting and candidate scheme: what the controller prices a
sampling request with, and which scheme (`moe_spec.policy.candidate_scheme`) it drafts.

Greedy acceptance says little about sampling: a node is accepted with the target's probability of
its token (top-token candidates) or by rejection against the draft's q (sampled candidates), never
by an argmax match. The profiler therefore decodes its prompts again at each setting it is asked for
(`ProfileSettings.sampling`), once per scheme, and keeps per (setting, scheme) the mean accepted
length at a reference budget and an `AcceptanceCalibration` fitted on the exact per-node
acceptance probabilities of steps decoded at the shape controllers draft under that scheme
(`StepRecord.acceptance_probability`): sampled candidates are drafted as chains (a later sibling,
drawn from the same q once the first draw is rejected, accepts little), and a calibration fitted on
60-node sampled trees, mostly siblings, priced a chain's third to fifth nodes at 0.16-0.34 where
chains accepted 0.26-0.52 (T = 0.7 top-p 0.9, 12 shipped prompts), so the sampled scheme's
calibration is fitted on chains (`calibration_shape`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from moe_spec.core.sampling import SamplingConfig
from moe_spec.profile.calibration import AcceptanceCalibration


@dataclass(frozen=True)
class SettingAcceptance:
    temperature: float
    top_k: int
    top_p: float
    sampled: bool  # the candidates were drawn from the draft distribution (else its top tokens)
    mean_accepted: float  # tokens per step, bonus included, at the reference budget
    steps: int  # speculative steps measured
    budget_nodes: int  # the reference budget's drafted nodes
    calibration: AcceptanceCalibration | None  # None when too few nodes were drafted to fit one
    calibration_shape: str = "reference"  # the candidates it was fitted on: "reference" (the budget above) or "chain:N"
    # sampled chains: mean P(node accepted | parent reached) per depth 1..N (exact probabilities of
    # the chain decode's nodes whose parent was reached), the prior chains are sized from
    # (`moe_spec.policy.chain_sizing`); empty when not measured
    chain_conditional: tuple[float, ...] = ()

    def __post_init__(self):
        SamplingConfig(self.temperature, self.top_k, self.top_p)  # validated as a request would be
        if self.temperature == 0:
            raise ValueError("a sampling setting has temperature > 0 (greedy is the profile's main calibration)")

    @property
    def label(self) -> str:
        return f"temperature {self.temperature}, top-k {self.top_k}, top-p {self.top_p}"

    def distance(self, sampling: SamplingConfig) -> float:
        """How far this setting is from a request: temperature and top-p differences, plus 0.5 for a
        different top-k (0 exactly when they match)."""
        return (abs(self.temperature - sampling.temperature) + abs(self.top_p - sampling.top_p)
                + (0.5 if self.top_k != sampling.top_k else 0.0))

    def to_dict(self) -> dict:
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p, "sampled": self.sampled,
                "mean_accepted": self.mean_accepted, "steps": self.steps, "budget_nodes": self.budget_nodes,
                "calibration": self.calibration.to_dict() if self.calibration is not None else None,
                "calibration_shape": self.calibration_shape, "chain_conditional": list(self.chain_conditional)}

    @staticmethod
    def from_dict(data: dict) -> "SettingAcceptance":
        calibration = AcceptanceCalibration.from_dict(data["calibration"]) if data.get("calibration") else None
        return SettingAcceptance(float(data["temperature"]), int(data["top_k"]), float(data["top_p"]),
                                 bool(data["sampled"]), float(data["mean_accepted"]), int(data["steps"]),
                                 int(data["budget_nodes"]), calibration, str(data.get("calibration_shape", "reference")),
                                 tuple(float(v) for v in data.get("chain_conditional", ())))


@dataclass(frozen=True)
class SchemeChoice:
    sampled: bool
    exact: bool  # a profiled setting matches the request exactly
    setting: str  # the profiled setting the choice comes from


def nearest_setting(entries: Sequence[SettingAcceptance], sampling: SamplingConfig) -> tuple[float, float, int]:
    """The (temperature, top-p, top-k) of the profiled setting nearest to `sampling`."""
    best = min(entries, key=lambda e: e.distance(sampling))
    return best.temperature, best.top_p, best.top_k


def preferred_scheme(entries: Sequence[SettingAcceptance], sampling: SamplingConfig) -> SchemeChoice:
    """The scheme with the longer measured acceptance at the setting nearest to `sampling` (top
    tokens when only they were measured there)."""
    key = nearest_setting(entries, sampling)
    here = [e for e in entries if (e.temperature, e.top_p, e.top_k) == key]
    best = max(here, key=lambda e: (e.mean_accepted, not e.sampled))  # ties: top tokens, the cheaper draft
    return SchemeChoice(best.sampled, best.distance(sampling) == 0.0, best.label)


def chain_conditional_for(entries: Sequence[SettingAcceptance], sampling: SamplingConfig) -> tuple[float, ...]:
    """The sampled chains' per-depth acceptance measured at the profiled setting nearest to
    `sampling` (empty: none measured there, or a greedy request)."""
    if sampling.greedy or not entries:
        return ()
    key = nearest_setting(entries, sampling)
    return next((e.chain_conditional for e in entries
                 if (e.temperature, e.top_p, e.top_k) == key and e.sampled and e.chain_conditional), ())


def calibration_for(entries: Sequence[SettingAcceptance], sampling: SamplingConfig, sampled: bool,
                    greedy: AcceptanceCalibration | None) -> AcceptanceCalibration | None:
    """The calibration of the profiled setting nearest to `sampling` for this scheme (falling back
    to the other scheme's there, then to the greedy one); `greedy` for greedy requests."""
    if sampling.greedy or not entries:
        return greedy
    key = nearest_setting(entries, sampling)
    here = [e for e in entries if (e.temperature, e.top_p, e.top_k) == key and e.calibration is not None]
    for entry in sorted(here, key=lambda e: e.sampled != sampled):
        return entry.calibration
    return greedy
