"""The profiler stage for offloaded experts: measure the fetch cost, then check it on real passes.

    profile = fetch_stage(target, drafter, prompts, profile)   # target.offload is installed

1. `ExpertOffload.measure_fetch_cost` times fetches of M random experts per layer (parallel reads
   into temporary slots) at a grid of M: the measured curve m_l(M) (`profile/fetch_cost.py`).
2. Decode the prompts through the offloaded target with static trees of several sizes, each prompt
   from a cold cache, and record every verify pass (tokens T, unique experts U_l, misses M_l, time).
3. The fixed cost `base`, the fetch scale s and the overflow cost o are refitted on the passes of
   the even-numbered prompts, every other term kept as measured (b and c with the experts resident,
   m_l from the store): base, what offloading adds per pass (the slot bookkeeping of every MoE layer)
   and what the decoding contexts add over the profiler's short prefix; s, what the pass's reads add
   to it per ms of the same reads timed alone, as the target reads them (on demand, or a layer ahead:
   `OffloadConfig.layer_ahead`, where reads overlap compute; the report names which); o, what each expert a layer needs beyond
   its C resident slots adds (streamed through scratch slots a chunk at a time: priced by m_l's one
   parallel read alone, the embedded pair's held-out passes priced above 30 ms took 1.4-1.6x their
   price at C = 16). Refitting b or c as well
   would let them soak up the fetch time (misses grow with U and T), pricing resident experts as if
   they were read. The profile keeps this,
   t = base' + b*T + sum_l (c U_l + s m_l(M_l) + o max(U_l - C, 0)).
4. The check, on the odd-numbered prompts' passes (held out from the fits): the relative error of
   the refit model, of it without the overflow term, of it with s = 1, of the resident profile's
   compute terms with the fetch term, and of compute alone.
"""

from __future__ import annotations

import itertools
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
    report = {"fetch_cost": fetch.to_dict(), "offload": offload.summary(), "reading": offload.config.reading}
    held_out = np.array(recorder.prompts) % 2 == 1
    if held_out.any() and (~held_out).any():
        tokens, unique, misses, rows, ms = (np.array(column, dtype=np.float64) for column in zip(*recorder.passes))
        refit = _refit_compute(cost, tokens[~held_out], unique[~held_out], misses[~held_out], ms[~held_out])
        no_overflow = _refit_compute(cost, tokens[~held_out], unique[~held_out], misses[~held_out], ms[~held_out],
                                     overflow=False)
        unscaled = _refit_compute(cost, tokens[~held_out], unique[~held_out], misses[~held_out], ms[~held_out],
                                  scale=False)

        def predicted(model, with_misses: bool) -> np.ndarray:
            return np.array([model.predict_ms(t, u, int(r), misses=m if with_misses else None)
                             for t, u, m, r in zip(tokens[held_out], unique[held_out], misses[held_out], rows[held_out])])

        measured = ms[held_out]
        report.update({
            "passes": len(recorder.passes), "fit_passes": int((~held_out).sum()), "heldout_passes": int(held_out.sum()),
            "mean_misses_per_pass": float(misses.sum(1).mean()),
            "refit_compute": {"base_ms": refit.base_ms, "resident_base_ms": cost.base_ms,
                              "per_token_ms": refit.per_token_ms, "per_expert_ms": list(refit.per_expert_ms),
                              "overflow_ms": refit.fetch.overflow_ms, "capacity": refit.fetch.capacity,
                              "fetch_scale": refit.fetch.scale},
            "mean_overflow_per_pass": float(np.mean([fetch.overflow(u).sum() for u in unique])),
            "error_refit_with_fetch_term": _errors(predicted(refit, True), measured),
            "error_refit_without_overflow_term": _errors(predicted(no_overflow, True), measured),
            "error_refit_without_fetch_scale": _errors(predicted(unscaled, True), measured),
            "error_resident_compute_with_fetch_term": _errors(predicted(cost, True), measured),
            "error_compute_only": _errors(predicted(cost, False), measured),
            "share_of_time_in_fetch": float(np.mean([fetch.total_ms(m) / t for m, t in zip(misses, ms)])),
            "points": [[float(a), float(b)] for a, b in zip(predicted(refit, True), measured)],  # held out (predicted, measured)
        })
        cost = refit
    return replace(profile, cost_model=cost, details={**profile.details, "fetch_cost_report": report})


def _refit_compute(cost: CostModel, tokens, unique, misses, ms, overflow: bool = True,
                   scale: bool = True) -> CostModel:
    """`cost` with base_ms, its fetch cost's scale (`scale`; else 1) and overflow_ms (`overflow`;
    else 0) refitted to what the passes took beyond its compute terms: least squares in relative
    error, each >= 0 (`_fit_nonnegative`)."""
    fetch = replace(cost.fetch, overflow_ms=0.0, scale=1.0)
    cost = replace(cost, fetch=fetch)
    compute = np.array([cost.predict_ms(t, u) - cost.base_ms for t, u in zip(tokens, unique)])  # [P]
    reads = np.array([fetch.total_ms(m) for m in misses])  # [P] sum_l m_l(M_l), the reads timed alone
    beyond = np.array([fetch.overflow(u).sum() for u in unique])  # [P] experts beyond the slots
    columns = [np.ones_like(ms)]
    if scale:
        columns.append(reads)
    if overflow:
        columns.append(beyond)
    fitted = iter(_fit_nonnegative(ms - compute - (0.0 if scale else reads), np.stack(columns, axis=1), ms))
    base = next(fitted)
    read_scale = next(fitted) if scale else 1.0
    per_overflow = next(fitted) if overflow else 0.0
    return replace(cost, base_ms=base, fetch=replace(fetch, overflow_ms=per_overflow, scale=read_scale),
                   source="measured; base, fetch scale and overflow refit on offloaded passes; fetch cost measured")


def _fit_nonnegative(residual: np.ndarray, columns: np.ndarray, ms: np.ndarray) -> np.ndarray:
    """[K] x >= 0 minimising sum(((residual - columns @ x) / ms)^2) (`columns` [P, K], a few): weighted
    least squares on every subset of the columns, the best whose coefficients are all >= 0 (a column
    left out is held at 0; a column of zeros tells nothing and stays 0)."""
    w = 1.0 / ms  # relative error: each row divided by its pass's time
    rows, target = columns * w[:, None], residual * w
    usable = [k for k in range(columns.shape[1]) if np.any(columns[:, k])]
    best, best_loss = np.zeros(columns.shape[1]), float((target ** 2).sum())
    for size in range(1, len(usable) + 1):
        for subset in itertools.combinations(usable, size):
            x = np.linalg.lstsq(rows[:, subset], target, rcond=None)[0]
            if np.any(x < 0):
                continue
            loss = float(((target - rows[:, subset] @ x) ** 2).sum())
            if loss < best_loss:
                best, best_loss = np.zeros(columns.shape[1]), loss
                best[list(subset)] = x
    return best
