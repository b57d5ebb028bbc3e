"""vLLM's own step costs: what a step of B requests verifying chains of K drafts costs *inside the
engine*, measured by running it, for pricing the exported schedule (`export-vllm --engine-costs`).

The profile prices a verify pass as transformers runs it; an engine adds its scheduler, sampler,
drafter and cache bookkeeping per step, so a schedule priced by the profile can speculate where the
engine's steps make it lose (on the tiny CPU target of `docs/vllm.md`, the profile's schedule chose
K = 1 where no speculation won). Here one engine per K in 0..K_max decodes the prompts at each batch
size B, timing each pass and counting its engine steps (per batch, its longest request's: a prefill
step and one per verification); the ms per step are then fitted, by non-negative least squares, as

    step_ms(B, K) = a + b B (K + 1) + c sum_l U_l(B, K + 1) + d K + e B K + f [K > 0]

U_l being the experts B rows of K + 1 tokens load in layer l (the profile's unique-experts curve,
`engine_schedule.union_experts`): a fixed part, the tokens, the expert union (the MoE term no engine
prices today), the drafter's forwards per depth and per drafted token, and what a speculative step
costs whatever its K (the proposer's call, the rejection sampler: on the tiny CPU target of
`docs/vllm.md`, K = 1 cost 1.2 ms a step more than no speculation at B = 1, where each further
depth cost 0.5-0.9 ms; without this term the fit priced K = 1 at 1.04x of no speculation, and it
ran at 0.77x). The fit prices every batch size the schedule covers, measured or not.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from moe_spec.errors import InputError
from moe_spec.integrations.vllm.engine_run import launch
from moe_spec.policy.engine_schedule import StepCost, union_experts
from moe_spec.profile.artifact import Profile

TERMS = ("fixed_ms", "per_token_ms", "per_expert_ms", "draft_per_depth_ms", "draft_per_token_ms", "speculating_ms")


@dataclass(frozen=True)
class EngineStep:
    """One measured configuration: B requests at a time, chains of K drafts (0: no speculation)."""

    rows: int
    length: int
    ms_per_step: float  # the fastest pass's wall time over its engine steps
    steps: int  # engine steps of one pass over the prompts


@dataclass(frozen=True)
class EngineCosts:
    """The fitted step price (`TERMS`, ms) and the measurements it was fitted to."""

    coefficients: tuple[float, ...]  # one per TERMS entry, all >= 0
    samples: tuple[EngineStep, ...]

    def step_cost(self, profile: Profile) -> StepCost:
        """(rows, length) -> predicted ms of such an engine step (the expert union from `profile`)."""
        weights = np.asarray(self.coefficients)
        return lambda rows, length: float(weights @ _terms(profile, rows, length))

    def to_dict(self) -> dict:
        return {"formula": "ms = fixed + per_token B (K + 1) + per_expert sum_l U_l + draft_per_depth K + draft_per_token B K"
                           " + speculating [K > 0]",
                **dict(zip(TERMS, self.coefficients)), "samples": [asdict(s) for s in self.samples]}

    @classmethod
    def from_dict(cls, document: dict) -> "EngineCosts":
        try:
            coefficients = tuple(float(document[term]) for term in TERMS)
            samples = tuple(EngineStep(int(s["rows"]), int(s["length"]), float(s["ms_per_step"]), int(s["steps"]))
                            for s in document["samples"])
        except (KeyError, TypeError, ValueError) as error:
            raise InputError(f"engine costs: not a file `export-vllm --engine-costs measure` wrote ({error!r})") from None
        if any(c < 0 or not np.isfinite(c) for c in coefficients):
            raise InputError(f"engine costs: every coefficient must be a finite number >= 0, got {coefficients}")
        return cls(coefficients, samples)

    @classmethod
    def load(cls, path: Path) -> "EngineCosts":
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError) as error:
            raise InputError(f"--engine-costs {path}: cannot be read as JSON ({error})") from None


def _terms(profile: Profile, rows: int, length: int) -> np.ndarray:
    """[6] the fit's regressors of a step of `rows` chains of `length` drafts."""
    return np.array([1.0, rows * (length + 1), float(union_experts(profile, rows, length + 1).sum()),
                     float(length), float(rows * length), float(length > 0)])


def fit(profile: Profile, samples: Sequence[EngineStep]) -> EngineCosts:
    """Non-negative least squares of the samples' ms per step on `_terms` (a term whose coefficient
    comes out negative is dropped and the rest refitted, until none is)."""
    if len(samples) < 2:
        raise InputError("engine costs need at least two measured configurations")
    x = np.stack([_terms(profile, s.rows, s.length) for s in samples])  # [S, 6]
    y = np.array([s.ms_per_step for s in samples])  # [S]
    kept = list(range(x.shape[1]))
    while True:
        solution = np.linalg.lstsq(x[:, kept], y, rcond=None)[0]
        if (solution >= 0).all():
            break
        del kept[int(np.argmin(solution))]
    coefficients = np.zeros(x.shape[1])
    coefficients[kept] = solution
    return EngineCosts(tuple(float(c) for c in coefficients), tuple(samples))


def steps_of(result: dict, length: int) -> EngineStep:
    """An `engine_run.py` result of one batch size -> its `EngineStep`."""
    steps = int(result["engine_steps"])
    return EngineStep(int(result["batch_size"]), length, 1000.0 * min(result["seconds"]) / max(steps, 1), steps)


def measure(model: Path, speculative_config_for, prompts: Sequence[Sequence[int]], lengths: Sequence[int],
            batch_sizes: Sequence[int], max_tokens: int, vllm_python: Path, repeats: int = 2) -> list[EngineStep]:
    """Decode `prompts` in vLLM (its own environment, `vllm_python`), one engine per chain length in
    `lengths` (0: no speculation; else `speculative_config_for(K)`), at each of `batch_sizes`."""
    if not Path(vllm_python).is_file():
        raise InputError(f"vLLM's environment is missing ({vllm_python}): `make vllm-env` makes it")
    runs = [{"name": f"K = {k}", "batch_sizes": list(batch_sizes), "repeats": repeats,
             "speculative_config": speculative_config_for(k) if k else None} for k in lengths]
    job = {"model": str(model), "dtype": "float32", "prompts": [list(map(int, p)) for p in prompts],
           "max_tokens": max_tokens, "max_model_len": max(len(p) for p in prompts) + max_tokens + 16, "runs": runs}
    root = str(Path(__file__).resolve().parents[3])  # moe_spec importable there (a proposer imports it)
    try:
        results = launch(job, str(vllm_python), root)["runs"]
    except RuntimeError as error:
        raise InputError(str(error)) from None
    per_engine = len(batch_sizes)
    return [steps_of(result, lengths[index // per_engine]) for index, result in enumerate(results)]
