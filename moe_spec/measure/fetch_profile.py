"""The profiler stage for offloaded experts: measure the fetch cost, then check it on real passes.

    profile = fetch_stage(target, drafter, prompts, profile)   # target.offload is installed

1. `ExpertOffload.measure_fetch_cost` times fetches of M random experts per layer (parallel reads
   into temporary slots) at a grid of M: the measured curve m_l(M) (`profile/fetch_cost.py`).
2. The check: decode the prompts through the offloaded target with static trees of several sizes,
   each prompt from a cold cache, and record every verify pass (tokens T, unique experts U_l, misses
   M_l, time). None of these passes was used to measure m_l, so they are held out. The report gives
   the relative error of the cost model with the fetch term, t = base + b*T + sum_l (c_l U_l +
   m_l(M_l)), beside the compute-only model and a least-squares refit of the compute terms with the
   fetch term kept as measured (what the controller would gain from refitting on this tier).
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
        self.passes: list[tuple[int, tuple[int, ...], tuple[int, ...], int, float]] = []  # (T, U, M, rows, ms)

    def on_step(self, record: StepRecord) -> None:
        if record.fetch is None:
            return
        self.passes.append((record.verified.pass_tokens, tuple(record.routing.unique_per_layer()),
                            record.fetch.per_layer_misses, record.verified.rows, record.verify_ms))


def _errors(predicted: np.ndarray, measured: np.ndarray) -> dict:
    rel = np.abs(predicted - measured) / measured
    return {"n": int(rel.size), "median": float(np.median(rel)), "p90": float(np.quantile(rel, 0.9)),
            "mean_signed": float(np.mean((predicted - measured) / measured))}


def fetch_stage(target, drafter, prompts: list[torch.Tensor], profile, budgets: tuple[int, ...] = (0, 2, 8, 32),
                max_new_tokens: int = 24, repeats: int = 5, progress=None):
    """`profile` with the offloaded target's measured fetch cost and its held-out check in `details`."""
    offload = target.offload
    fetch = offload.measure_fetch_cost(repeats=repeats)
    cost = replace(profile.cost_model, fetch=fetch)
    recorder = _PassRecorder()
    runs = [(nodes, ids) for nodes in (budgets if drafter is not None else (0,)) for ids in prompts]
    for nodes, ids in (progress(runs) if progress else runs):
        offload.clear()
        controller = StaticController(EAGLE2_BUDGET.with_nodes(nodes)) if nodes else None
        SpecDecoder(target, drafter if nodes else None, controller, observer=recorder).generate(
            ids[None], max_new_tokens=max_new_tokens)
    report = {"fetch_cost": fetch.to_dict(), "offload": offload.summary()}
    if recorder.passes:
        tokens, unique, misses, rows, ms = (np.array(column, dtype=np.float64) for column in zip(*recorder.passes))
        with_fetch = np.array([cost.predict_ms(t, u, int(r), misses=m) for t, u, m, r in zip(tokens, unique, misses, rows)])
        compute_only = np.array([cost.predict_ms(t, u, int(r)) for t, u, r in zip(tokens, unique, rows)])
        refit = _refit_compute(cost, tokens, unique, misses, ms)
        refitted = np.array([refit.predict_ms(t, u, int(r), misses=m) for t, u, m, r in zip(tokens, unique, misses, rows)])
        report.update({
            "passes": len(recorder.passes), "mean_misses_per_pass": float(misses.sum(1).mean()),
            "error_with_fetch_term": _errors(with_fetch, ms), "error_compute_only": _errors(compute_only, ms),
            "error_refit_compute_with_fetch_term": _errors(refitted, ms),
            "share_of_time_in_fetch": float(np.mean(np.array([fetch.total_ms(m) for m in misses]) / ms)),
            "points": [[float(a), float(b)] for a, b in zip(with_fetch, ms)],  # (predicted, measured) ms, for plots
        })
    return replace(profile, cost_model=cost, details={**profile.details, "fetch_cost_report": report})


def _refit_compute(cost: CostModel, tokens, unique, misses, ms) -> CostModel:
    """The compute terms refitted (least squares, relative error) to the time left after the measured fetch term."""
    fetch = np.array([cost.fetch.total_ms(m) for m in misses])
    rest = np.maximum(ms - fetch, 1e-3)
    design = np.column_stack([np.ones_like(tokens), tokens, unique.sum(1)]) / ms[:, None]
    coef, *_ = np.linalg.lstsq(design, rest / ms, rcond=None)
    coef = np.maximum(coef, 0.0)
    return replace(cost, base_ms=float(coef[0]), per_token_ms=float(coef[1]), per_expert_ms=(float(coef[2]),),
                   source="refit on offloaded passes")
