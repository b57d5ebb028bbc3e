"""What one verification forward costs, as explicit terms with units.

    verify_ms(B, T, U) = base_ms + per_row_ms * (B - 1) + per_token_ms * T + sum_l per_expert_ms[l] * U[l]

- B: rows in the pass (a batch verifies B rows' trees in one forward; 1 for a single sequence);
- T: tokens in the verify pass over all rows (tree nodes, roots included);
- U[l]: distinct experts MoE layer l activates over those T tokens (each is a weight load
  and a small matmul, which is why an MoE verify pass grows with U, not only with T);
- base_ms [ms]: the per-call overhead of a one-row pass (attention over the cached prefix, dense
  layers, lm_head setup, Python); per_row_ms [ms per row after the first]: what each further row
  adds beyond its tokens (attention over its own prefix, its padding, per-row bookkeeping);
  per_token_ms [ms/token]; per_expert_ms [ms per layer-expert], one shared value or one per MoE layer.

The row term counts rows after the first so that base_ms keeps meaning "one row's call": a
profile without batched passes (or written before the term existed) has per_row_ms = 0 and
predicts single-row passes exactly as before.

With the routed experts offloaded to a slower tier (`moe_spec.offload`), a pass also pays for the
experts it must fetch: `fetch` (a measured `FetchCost`) adds sum_l m_l(M_l), M_l the experts of
layer l that are not resident when the pass needs them; without it the model prices compute only.

The coefficients are measured (`fit`, from the profiler's latency grid), or derived from model
shapes and a device's bandwidth and FLOP rate by `moe_spec.experiments.analytic_cost.analytic_cost_model`
(bytes moved per expert / bytes per ms), which returns the same dataclass.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from moe_spec.core.tree import DraftTree
from moe_spec.profile.fetch_cost import FetchCost


@dataclass(frozen=True)
class CostSample:
    """One timed verify pass."""

    num_tokens: int  # T
    unique_experts: tuple[int, ...]  # U per MoE layer, the union over all rows
    ms: float
    rows: int = 1  # B: rows verified in the pass


@dataclass(frozen=True)
class CostModel:
    base_ms: float  # ms per verify call
    per_token_ms: float  # ms per verified token
    per_expert_ms: tuple[float, ...]  # ms per unique expert, per MoE layer (length 1: shared by all layers)
    num_layers: int  # MoE layers the model has (0: dense)
    source: str = "measured"
    per_row_ms: float = 0.0  # ms per row after the first in a batched pass
    fetch: FetchCost | None = None  # offloaded experts: ms of fetching M_l missing experts per layer

    def __post_init__(self):
        if self.fetch is not None and self.fetch.num_layers != self.num_layers:
            raise ValueError(f"the fetch cost has {self.fetch.num_layers} layers, the cost model {self.num_layers}")
        if len(self.per_expert_ms) not in (1, max(self.num_layers, 1)):
            raise ValueError(f"per_expert_ms needs 1 or {self.num_layers} values, got {len(self.per_expert_ms)}")
        values = (self.base_ms, self.per_token_ms, self.per_row_ms, *self.per_expert_ms)
        if not all(math.isfinite(v) for v in values):
            raise ValueError(f"cost model coefficients must be finite, got {values}")

    @property
    def per_layer(self) -> bool:
        return len(self.per_expert_ms) > 1

    def expert_weights(self) -> np.ndarray:
        """[L] ms per unique expert in each MoE layer."""
        return np.broadcast_to(np.asarray(self.per_expert_ms, dtype=np.float64), (self.num_layers,))

    def scaled(self, factor: float, row_ms: float = 0.0, fetch_factor: float = 1.0) -> "CostModel":
        """Every compute term times `factor` (a machine running at another speed than profiled),
        then `row_ms` added to the per-row term, and the fetch cost times `fetch_factor` (reads
        costing the run otherwise than profiled, `FetchCost.times`). A negative `row_ms` (per-row
        work the profile overestimated) is applied as given; `fixed_ms` keeps the fixed part of a
        pass >= 0."""
        fetch = self.fetch if self.fetch is None or fetch_factor == 1.0 else self.fetch.times(fetch_factor)
        # built directly, not by `dataclasses.replace` (rebuilt whenever the online scale moves, on
        # the controller's critical path)
        return CostModel(self.base_ms * factor, self.per_token_ms * factor, tuple(v * factor for v in self.per_expert_ms),
                         self.num_layers, self.source, self.per_row_ms * factor + row_ms, fetch)

    def fixed_ms(self, rows: int = 1) -> float:
        """The part of a pass of `rows` rows that depends on neither tokens nor experts."""
        if rows < 1:
            raise ValueError(f"a verify pass has at least one row, got {rows}")
        return max(self.base_ms + self.per_row_ms * (rows - 1), 0.0)

    def predict_ms(self, num_tokens: float, unique_experts_per_layer: Sequence[float] | torch.Tensor, rows: int = 1,
                   misses: Sequence[float] | None = None) -> float:
        """Verify time in ms for one pass of `rows` rows, T tokens in all, activating U[l] distinct
        experts in each MoE layer (the union over the rows), M[l] of which must be fetched (`misses`;
        priced only when the model has a `fetch` cost, with the experts beyond its resident capacity)."""
        unique = np.asarray(torch.as_tensor(unique_experts_per_layer, dtype=torch.float64).cpu(), dtype=np.float64)
        if unique.shape != (self.num_layers,):
            raise ValueError(f"expected {self.num_layers} unique-expert counts, got shape {unique.shape}")
        fetch = self.fetch.total_ms(misses, unique) if self.fetch is not None and misses is not None else 0.0
        return float(self.fixed_ms(rows) + self.per_token_ms * num_tokens + (self.expert_weights() * unique).sum()
                     + fetch)

    def predict(self, tree: DraftTree, predicted_experts: torch.Tensor) -> float:
        """Verify time in ms for a tree; predicted_experts: [L, N, E], the probability (or 0/1) that
        node n activates expert e in layer l. U[l] is the expected number of distinct experts."""
        if predicted_experts.dim() != 3 or predicted_experts.shape[:2] != (self.num_layers, len(tree)):
            raise ValueError(
                f"predicted_experts must be [L={self.num_layers}, N={len(tree)}, E], got {tuple(predicted_experts.shape)}"
            )
        return self.predict_ms(len(tree), expected_unique_experts(predicted_experts))

    def to_dict(self) -> dict:
        return {
            "formula": "ms = base_ms + per_row_ms * (B - 1) + per_token_ms * T + sum_l per_expert_ms[l] * U[l]"
                       + (" + sum_l m_l(M[l]) + overflow_ms * max(U[l] - capacity, 0)" if self.fetch is not None else ""),
            "base_ms": self.base_ms,
            "per_row_ms": self.per_row_ms,
            "per_token_ms": self.per_token_ms,
            "per_expert_ms": list(self.per_expert_ms),
            "num_layers": self.num_layers,
            "source": self.source,
            **({"fetch": self.fetch.to_dict()} if self.fetch is not None else {}),
        }

    @staticmethod
    def from_dict(data: dict) -> "CostModel":
        return CostModel(
            base_ms=float(data["base_ms"]),
            per_token_ms=float(data["per_token_ms"]),
            per_expert_ms=tuple(float(v) for v in data["per_expert_ms"]),
            num_layers=int(data["num_layers"]),
            source=str(data.get("source", "measured")),
            per_row_ms=float(data.get("per_row_ms", 0.0)),  # absent from profiles made before batched passes
            fetch=FetchCost.from_dict(data["fetch"]) if data.get("fetch") else None,
        )

    @staticmethod
    def fit(samples: Sequence[CostSample], per_layer: bool = False, relative: bool = True) -> "CostModel":
        """Least-squares fit of the coefficients to timed samples.

        relative=True weights each sample by 1 / ms, i.e. minimises squared *relative* error,
        which is what the 10% accuracy goal is stated in. Coefficients are kept >= 0 (a negative
        cost per expert would reward activating more experts). per_layer fits one expert cost per MoE
        layer; it needs samples whose U differs between layers (natural trees), else the layers'
        columns are collinear and least squares splits the cost evenly (minimum-norm solution).
        per_row_ms is fitted only when the samples hold passes of more than one row count; with one
        count its column is constant (or zero) beside the intercept and cannot be told apart.
        """
        if not samples:
            raise ValueError("cannot fit a cost model to no samples")
        num_layers = len(samples[0].unique_experts)
        if any(len(s.unique_experts) != num_layers for s in samples):
            raise ValueError("every sample needs the same number of MoE layers")
        if any(s.rows < 1 for s in samples):
            raise ValueError("every sample needs at least one row")
        row_term = len({s.rows for s in samples}) > 1
        design, target = _design(samples, per_layer and num_layers > 1, row_term)
        if relative:
            weight = 1.0 / np.maximum(target, 1e-9)
            design, target = design * weight[:, None], target * weight
        coef = _nonnegative_least_squares(design, target)
        per_row = float(coef[1]) if row_term else 0.0
        coef = np.delete(coef, 1) if row_term else coef  # [1, T, experts...]
        per_expert = tuple(float(c) for c in coef[2:]) if num_layers else (0.0,)
        return CostModel(float(coef[0]), float(coef[1]), per_expert or (0.0,), num_layers, per_row_ms=per_row)


def _design(samples: Sequence[CostSample], per_layer: bool, row_term: bool) -> tuple[np.ndarray, np.ndarray]:
    """[S, 2 + R + L'] design matrix (1, B - 1 when row_term, T, U or U per layer) and [S] times in ms."""
    tokens = np.array([s.num_tokens for s in samples], dtype=np.float64)
    extra_rows = np.array([s.rows - 1 for s in samples], dtype=np.float64)
    unique = np.array([s.unique_experts for s in samples], dtype=np.float64).reshape(len(samples), -1)  # [S, L]
    experts = unique if per_layer else unique.sum(axis=1, keepdims=True)
    columns = [np.ones_like(tokens), *([extra_rows] if row_term else []), tokens]
    design = np.column_stack(columns + ([experts] if unique.shape[1] else []))
    return design, np.array([s.ms for s in samples], dtype=np.float64)


def _nonnegative_least_squares(design: np.ndarray, target: np.ndarray) -> np.ndarray:
    """min ||design @ coef - target|| with coef >= 0, by dropping the most negative column until
    none is negative (an active-set method; exact for the few, mostly positive terms here)."""
    active = list(range(design.shape[1]))
    coef = np.zeros(design.shape[1])
    while active:
        solution, *_ = np.linalg.lstsq(design[:, active], target, rcond=None)
        if (solution >= 0).all():
            coef[active] = solution
            break
        active.pop(int(np.argmin(solution)))
    return coef


def expected_unique_experts(probabilities: torch.Tensor) -> torch.Tensor:
    """[L] expected distinct experts per layer: sum_e 1 - prod_n (1 - p[l, n, e]).

    probabilities: [L, N, E]. Exact for 0/1 inputs; for probabilities it treats nodes as
    independent, which is how a per-token predictor's output is priced.
    """
    p = probabilities.to(torch.float64).clamp(0.0, 1.0)
    return (1.0 - torch.prod(1.0 - p, dim=1)).sum(dim=-1)


def predict_sample(model: CostModel, sample: CostSample) -> float:
    """The model's time for the pass a sample timed."""
    return model.predict_ms(sample.num_tokens, sample.unique_experts, sample.rows)


def relative_errors(model: CostModel, samples: Sequence[CostSample]) -> np.ndarray:
    """[S] |predicted - measured| / measured."""
    return np.array([abs(predict_sample(model, s) - s.ms) / s.ms for s in samples])


def r_squared(model: CostModel, samples: Sequence[CostSample]) -> float:
    measured = np.array([s.ms for s in samples])
    predicted = np.array([predict_sample(model, s) for s in samples])
    total = ((measured - measured.mean()) ** 2).sum()
    return float(1.0 - ((measured - predicted) ** 2).sum() / total) if total > 0 else float("nan")
