"""The profiler stage for offloaded experts: measure the fetch cost, then check it on real passes.

    profile = fetch_stage(target, drafter, prompts, profile)   # target.offload is installed

1. `ExpertOffload.measure_fetch_cost` times fetches of M random experts per layer (parallel reads
   into temporary slots) at a grid of M: the measured curve m_l(M) (`profile/fetch_cost.py`).
2. Decode the prompts through the offloaded target with static trees of several sizes, each prompt
   from a cold cache, and record every verify pass (tokens T, unique experts U_l, misses M_l, time).
3. The fixed cost `base` and the overflow cost o are refitted on the passes of the even-numbered
   prompts, every other term kept as measured (b and c with the experts resident, m_l from the
   store): base, what offloading adds per pass (the slot bookkeeping of every MoE layer) and what the
   decoding contexts add over the profiler's short prefix; o, what each expert a layer needs beyond
   its C resident slots adds (streamed through scratch slots a chunk at a time: priced by m_l's one
   parallel read alone, the embedded pair's held-out passes priced above 30 ms took 1.4-1.6x their
   price at C = 16). Refitting b or c as well
   would let them soak up the fetch time (misses grow with U and T), pricing resident experts as if
   they were read. The profile keeps this,
   t = base' + b*T + sum_l (c U_l + m_l(M_l) + o max(U_l - C, 0)).
4. The check, on the odd-numbered prompts' passes (held out from both fits): the relative error of
   the refit model, of it without the overflow term, of the resident profile's compute terms with
   the fetch term, and of compute alone.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from moe_spec.core.drafting import EAGLE2_BUDGET
from moe_spec.core.engine import SpecDecoder
from moe_spec.core.step_record import DecodeObserver, StepRecord
from moe_spec.policy.static import StaticController
from moe_spec.profile.cost_model import CostModel


class _PassRecorder(DecodeObserver):
    def __init__(self):
        self.prompt = 0  # which prompt the next passes belong to (set by the caller)
        self.passes: list[tuple[int, tuple[int, ...], tuple[int, ...], int, float]] = []  # (T, U, M, rows, ms)
        self.prompts: list[int] = []

    def on_step(self, record: StepRecord) -> None:
        if record.fetch is None:
            return
        self.passes.append((record.verified.pass_tokens, tuple(record.routing.unique_per_layer()),
                            record.fetch.per_layer_misses, record.verified.rows, record.verify_ms))
        self.prompts.append(self.prompt)


def _errors(predicted: np.ndarray, measured: np.ndarray) -> dict:
    rel = np.abs(predicted - measured) / measured
    return {"n": int(rel.size), "median": float(np.median(rel)), "p90": float(np.quantile(rel, 0.9)),
            "mean_signed": float(np.mean((predicted - measured) / measured))}


def fetch_stage(target, drafter, prompts: list[torch.Tensor], profile, budgets: tuple[int, ...] = (0, 2, 8, 32),
                max_new_tokens: int = 24, repeats: int = 5, progress=None):
    """`profile` with the offloaded target's measured fetch cost and its held-out check in `details`."""
    offload = target.offload
    fetch = offload.measure_fetch_cost(repeats=repeats).at_capacity(offload.capacity)
    cost = replace(profile.cost_model, fetch=fetch)
    recorder = _PassRecorder()
    runs = [(nodes, i, ids) for nodes in (budgets if drafter is not None else (0,)) for i, ids in enumerate(prompts)]
    for nodes, i, ids in (progress(runs) if progress else runs):
        offload.clear()
        recorder.prompt = i
        controller = StaticController(EAGLE2_BUDGET.with_nodes(nodes)) if nodes else None
        SpecDecoder(target, drafter if nodes else None, controller, observer=recorder).generate(
            ids[None], max_new_tokens=max_new_tokens)
    report = {"fetch_cost": fetch.to_dict(), "offload": offload.summary()}
    held_out = np.array(recorder.prompts) % 2 == 1
    if held_out.any() and (~held_out).any():
        tokens, unique, misses, rows, ms = (np.array(column, dtype=np.float64) for column in zip(*recorder.passes))
        refit = _refit_compute(cost, tokens[~held_out], unique[~held_out], misses[~held_out], ms[~held_out])
        no_overflow = _refit_compute(cost, tokens[~held_out], unique[~held_out], misses[~held_out], ms[~held_out],
                                     overflow=False)

        def predicted(model, with_misses: bool) -> np.ndarray:
            return np.array([model.predict_ms(t, u, int(r), misses=m if with_misses else None)
                             for t, u, m, r in zip(tokens[held_out], unique[held_out], misses[held_out], rows[held_out])])

        measured = ms[held_out]
        report.update({
            "passes": len(recorder.passes), "fit_passes": int((~held_out).sum()), "heldout_passes": int(held_out.sum()),
            "mean_misses_per_pass": float(misses.sum(1).mean()),
            "refit_compute": {"base_ms": refit.base_ms, "resident_base_ms": cost.base_ms,
                              "per_token_ms": refit.per_token_ms, "per_expert_ms": list(refit.per_expert_ms),
                              "overflow_ms": refit.fetch.overflow_ms, "capacity": refit.fetch.capacity},
            "mean_overflow_per_pass": float(np.mean([fetch.overflow(u).sum() for u in unique])),
            "error_refit_with_fetch_term": _errors(predicted(refit, True), measured),
            "error_refit_without_overflow_term": _errors(predicted(no_overflow, True), measured),
            "error_resident_compute_with_fetch_term": _errors(predicted(cost, True), measured),
            "error_compute_only": _errors(predicted(cost, False), measured),
            "share_of_time_in_fetch": float(np.mean([fetch.total_ms(m) / t for m, t in zip(misses, ms)])),
            "points": [[float(a), float(b)] for a, b in zip(predicted(refit, True), measured)],  # held out (predicted, measured)
        })
        cost = refit
    return replace(profile, cost_model=cost, details={**profile.details, "fetch_cost_report": report})


def _refit_compute(cost: CostModel, tokens, unique, misses, ms, overflow: bool = True) -> CostModel:
    """`cost` with base_ms and (`overflow`) its fetch cost's overflow_ms refitted to what the passes
    took beyond its other terms: least squares in relative error, both >= 0 (`_fit_base_and_slope`)."""
    fetch = replace(cost.fetch, overflow_ms=0.0)
    cost = replace(cost, fetch=fetch)
    others = np.array([cost.predict_ms(t, u, misses=m) - cost.base_ms for t, u, m in zip(tokens, unique, misses)])
    residual = ms - others  # [P] ms the fixed cost and the overflow must explain
    beyond = np.array([fetch.overflow(u).sum() for u in unique]) if overflow else np.zeros_like(ms)  # [P]
    base, per_overflow = _fit_base_and_slope(residual, beyond, ms)
    return replace(cost, base_ms=base, fetch=replace(fetch, overflow_ms=per_overflow),
                   source="measured; base and overflow refit on offloaded passes; fetch cost measured")


def _fit_base_and_slope(residual: np.ndarray, x: np.ndarray, ms: np.ndarray) -> tuple[float, float]:
    """(a, b) >= 0 minimising sum(((residual - a - b x) / ms)^2): weighted least squares in closed
    form, with a bound at 0 refitted with the other term alone."""
    w = 1.0 / ms**2

    def alone_a() -> float:
        return float(max((w * residual).sum() / w.sum(), 0.0))

    def alone_b() -> float:
        denominator = (w * x * x).sum()
        return float(max((w * x * residual).sum() / denominator, 0.0)) if denominator > 0 else 0.0

    if not (w * x * x).sum():
        return alone_a(), 0.0
    matrix = np.array([[w.sum(), (w * x).sum()], [(w * x).sum(), (w * x * x).sum()]])
    a, b = np.linalg.lstsq(matrix, np.array([(w * residual).sum(), (w * x * residual).sum()]), rcond=None)[0]
    if b < 0:
        return alone_a(), 0.0
    if a < 0:
        return 0.0, alone_b()
    return float(a), float(b)
