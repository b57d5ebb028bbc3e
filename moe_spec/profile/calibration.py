"""Acceptance calibration: from the drafter's confidence to the observed acceptance of a node.

Raw draft probabilities are badly calibrated (FINDINGS: they summed to 1.04 per step while 2.54
nodes were accepted), so a controller pricing nodes by them stops far too early. We fit, per
depth bucket, a monotone (isotonic, pool-adjacent-violators) map from

- the node's *conditional* draft probability q = exp(score - parent score) to the rate at which
  its token equals the target's argmax at its parent ("conditionally accepted", see
  `moe_spec.core.step_record`),
  over the nodes whose parent was reached (lay on the accepted path);
- the node's *cumulative* draft probability exp(score) to the rate at which it lies on the
  accepted path (a direct estimate, kept to check the product below against).

`path_probability(tree)` is P(node on the accepted path) = the product of the calibrated
conditional probabilities along the node's path, which is exact under greedy acceptance when
the conditional events are independent given the confidences. Reliability is reported as the
expected calibration error (ECE) of cross-fitted predictions (each fold predicted by maps fitted
on the other folds), beside the ECE of the raw draft probabilities.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from moe_spec.core.step_record import StepRecord
from moe_spec.core.tree import DraftTree


def isotonic_regression(x: np.ndarray, y: np.ndarray, weight: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Pool-adjacent-violators: the non-decreasing fit of y on x minimising weighted squared error.

    Returns the knots (x_k, v_k) of the fitted step function: one per block of pooled points,
    x_k the weighted mean x of the block, v_k its weighted mean y; both non-decreasing.
    """
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    w = np.ones_like(y) if weight is None else np.asarray(weight, dtype=np.float64)
    if x.size == 0:
        raise ValueError("isotonic regression needs at least one point")
    # points with equal x are one point (their weighted mean): a fit cannot separate them
    unique_x, group = np.unique(x, return_inverse=True)
    group_w = np.bincount(group, weights=w)
    group_y = np.bincount(group, weights=w * y) / group_w
    means, weights, xs = [], [], []
    for xi, yi, wi in zip(unique_x, group_y, group_w):
        means.append(yi)
        weights.append(wi)
        xs.append(xi)
        while len(means) > 1 and means[-2] >= means[-1]:
            total = weights[-2] + weights[-1]
            merged = (means[-2] * weights[-2] + means[-1] * weights[-1]) / total
            merged_x = (xs[-2] * weights[-2] + xs[-1] * weights[-1]) / total
            means[-2:], weights[-2:], xs[-2:] = [merged], [total], [merged_x]
    return np.array(xs), np.array(means)


@dataclass(frozen=True)
class IsotonicMap:
    """A non-decreasing map, linear between knots and constant beyond them."""

    knots_x: tuple[float, ...]
    knots_y: tuple[float, ...]
    samples: int

    @staticmethod
    def fit(x: np.ndarray, y: np.ndarray) -> "IsotonicMap":
        knots_x, knots_y = isotonic_regression(x, y)
        return IsotonicMap(tuple(knots_x.tolist()), tuple(knots_y.tolist()), int(len(x)))

    def __call__(self, x: np.ndarray) -> np.ndarray:
        knots = self.__dict__.get("_arrays")
        if knots is None:  # the knots as arrays, once (np.interp would convert the tuples every call)
            knots = (np.asarray(self.knots_x, dtype=np.float64), np.asarray(self.knots_y, dtype=np.float64))
            object.__setattr__(self, "_arrays", knots)
        return np.interp(np.asarray(x, dtype=np.float64), *knots)

    def at(self, x: float) -> float:
        """The map at one point, in plain Python: what `__call__` (np.interp) computes, with its
        arithmetic, for the controller's one-row trees (a few nodes, where a numpy call costs more
        than the interpolation)."""
        xs, ys = self.knots_x, self.knots_y
        if x >= xs[-1]:
            return ys[-1]
        if x <= xs[0]:
            return ys[0]
        j = bisect_right(xs, x) - 1  # xs[j] <= x < xs[j + 1]
        if xs[j] == x:
            return ys[j]
        slope = (ys[j + 1] - ys[j]) / (xs[j + 1] - xs[j])
        return slope * (x - xs[j]) + ys[j]

    def to_dict(self) -> dict:
        return {"x": list(self.knots_x), "y": list(self.knots_y), "samples": self.samples}

    @staticmethod
    def from_dict(data: dict) -> "IsotonicMap":
        knots_x, knots_y = tuple(float(v) for v in data["x"]), tuple(float(v) for v in data["y"])
        if not knots_x or len(knots_x) != len(knots_y):
            raise ValueError("an isotonic map needs as many y knots as x knots, at least one")
        if any(b < a for a, b in zip(knots_x, knots_x[1:])) or any(b < a for a, b in zip(knots_y, knots_y[1:])):
            raise ValueError("isotonic map knots must be non-decreasing")
        return IsotonicMap(knots_x, knots_y, int(data["samples"]))


@dataclass(frozen=True)
class NodeSamples:
    """Per drafted node (roots excluded), concatenated over steps."""

    conditional_q: np.ndarray  # draft probability of the node given its parent
    cumulative_q: np.ndarray  # draft probability of the node's whole path
    depth: np.ndarray  # int, >= 1
    conditional_accepted: np.ndarray  # float: P(accepted | parent reached), 0/1 under greedy decoding
    parent_reached: np.ndarray  # bool: the parent lies on the accepted path (root counts)
    on_path: np.ndarray  # bool
    step: np.ndarray  # int: index of the step the node came from
    group: np.ndarray  # int: prompt index, the unit of cross-fitting folds
    top: np.ndarray | None = None  # bool: its parent's first child (sibling rank 0); None: every node alike

    @staticmethod
    def from_steps(steps: Sequence[StepRecord], groups: Sequence[int] | None = None) -> "NodeSamples":
        """The verified nodes of one-row step records (`StepRecord.row`); `groups[i]` is step i's
        cross-fitting unit (the prompt it decoded), each step its own by default."""
        groups = range(len(steps)) if groups is None else groups
        if len(groups) != len(steps):
            raise ValueError(f"{len(groups)} groups for {len(steps)} steps")
        parts = []
        for index, (step, group) in enumerate(zip(steps, groups)):
            if step.batch != 1:
                raise ValueError(f"calibration samples come from one-row records, got a batch of {step.batch}")
            tree, on_path = step.tree(), step.on_path()
            scores = tree.scores.double()
            parents = tree.parents.clamp(min=0)
            drafted = slice(1, len(tree))
            parts.append(
                (
                    torch.exp(scores - scores[parents])[drafted].numpy(),
                    torch.exp(scores)[drafted].numpy(),
                    tree.depths[drafted].numpy(),
                    step.acceptance_probability()[drafted].numpy(),
                    on_path[parents][drafted].numpy(),
                    on_path[drafted].numpy(),
                    np.full(len(tree) - 1, index),
                    np.full(len(tree) - 1, group),
                    (tree.sibling_ranks == 0)[drafted].numpy(),
                )
            )
        if not parts:
            empty = np.zeros(0)
            flags = empty.astype(bool)
            return NodeSamples(empty, empty, empty.astype(int), flags, flags, flags, empty.astype(int), empty.astype(int),
                               flags)
        columns = [np.concatenate(c) for c in zip(*parts)]
        return NodeSamples(*columns)

    def __len__(self) -> int:
        return int(self.depth.shape[0])

    def subset(self, mask: np.ndarray) -> "NodeSamples":
        return NodeSamples(*(getattr(self, f)[mask] if getattr(self, f) is not None else None
                             for f in self.__dataclass_fields__))


@dataclass(frozen=True)
class AcceptanceCalibration:
    """Isotonic maps per depth bucket; bucket d holds depth d, the last bucket every deeper node.

    A node's conditional acceptance depends on its rank among its siblings as well as on its q:
    where the head spreads its probability, its first child at q = 0.05 was accepted 44% of the
    time and the other children at that q 1% (greedy EAGLE-2 trees on the profiling prompts, depth
    1), so one map over both priced the first child at 5% and the steps that needed it verified no
    drafted node. `top_conditional` maps the first children (sibling rank 0), `conditional` the
    others; a calibration without `top_conditional` (fitted before ranks were recorded) maps every
    node with `conditional`."""

    conditional: tuple[IsotonicMap, ...]  # [buckets]: conditional q -> P(conditionally accepted), later siblings
    path: tuple[IsotonicMap, ...]  # [buckets]: cumulative q -> P(on accepted path)
    max_depth_bucket: int
    top_conditional: tuple[IsotonicMap, ...] | None = None  # [buckets]: the same for first children; None: as the rest

    def __post_init__(self):
        if self.top_conditional is not None and len(self.top_conditional) != self.max_depth_bucket:
            raise ValueError(f"calibration needs {self.max_depth_bucket} first-child maps, got {len(self.top_conditional)}")

    @staticmethod
    def fit(samples: NodeSamples, max_depth_bucket: int = 4, min_bucket_samples: int = 50) -> "AcceptanceCalibration":
        """Conditional maps are fitted on nodes whose parent was reached (the chain rule's factors),
        first children and later siblings apart when the samples record ranks; path maps on every
        node. A bucket with fewer than `min_bucket_samples` nodes of its kind uses the map of that
        kind fitted on all depths (of every node, when the kind has fewer than that in all)."""
        if len(samples) == 0:
            raise ValueError("no drafted nodes to calibrate on (did the drafter propose anything?)")
        buckets = np.minimum(samples.depth, max_depth_bucket)
        reached = samples.parent_reached  # never empty: the root's children have their parent reached
        pooled_p = IsotonicMap.fit(samples.cumulative_q, samples.on_path)
        path = []
        for bucket in range(1, max_depth_bucket + 1):
            mask = buckets == bucket
            path.append(IsotonicMap.fit(samples.cumulative_q[mask], samples.on_path[mask])
                        if mask.sum() >= min_bucket_samples else pooled_p)

        def conditional_maps(kind: np.ndarray) -> tuple[IsotonicMap, ...]:
            """Per bucket, the map fitted on the reached nodes of `kind` [nodes] bool."""
            pool = reached & kind if (reached & kind).sum() >= min_bucket_samples else reached
            pooled = IsotonicMap.fit(samples.conditional_q[pool], samples.conditional_accepted[pool])
            maps = []
            for bucket in range(1, max_depth_bucket + 1):
                mask = (buckets == bucket) & reached & kind
                maps.append(IsotonicMap.fit(samples.conditional_q[mask], samples.conditional_accepted[mask])
                            if mask.sum() >= min_bucket_samples else pooled)
            return tuple(maps)

        if samples.top is None:  # no ranks recorded: one map for every node
            return AcceptanceCalibration(conditional_maps(np.ones(len(samples), dtype=bool)), tuple(path), max_depth_bucket)
        return AcceptanceCalibration(conditional_maps(~samples.top), tuple(path), max_depth_bucket,
                                     conditional_maps(samples.top))

    def _bucket(self, depth: np.ndarray) -> np.ndarray:
        return np.clip(depth, 1, self.max_depth_bucket) - 1

    def conditional_map(self, depth: int, top: bool = False) -> IsotonicMap:
        """The map of conditional q -> P(conditionally accepted) for nodes at `depth` (>= 1): of a
        parent's first child when `top` (where the calibration tells them apart)."""
        maps = self.top_conditional if top and self.top_conditional is not None else self.conditional
        return maps[min(max(depth, 1), self.max_depth_bucket) - 1]

    def conditional_probability_of(self, conditional_q: np.ndarray, depth: np.ndarray,
                                   top: np.ndarray | None = None) -> np.ndarray:
        """Calibrated conditional acceptance of nodes with these q, depths and (bool, None: none
        first) first-child flags."""
        out = np.empty(len(depth))
        bucket = self._bucket(np.asarray(depth))
        top = np.zeros(len(depth), dtype=bool) if top is None else np.asarray(top, dtype=bool)
        for b in np.unique(bucket):
            for first in (False, True):
                mask = (bucket == b) & (top == first)
                if mask.any():
                    out[mask] = self.conditional_map(int(b) + 1, first)(conditional_q[mask])
        return out

    def direct_path_probability_of(self, cumulative_q: np.ndarray, depth: np.ndarray) -> np.ndarray:
        out = np.empty(len(depth))
        bucket = self._bucket(np.asarray(depth))
        for b in np.unique(bucket):
            mask = bucket == b
            out[mask] = self.path[b](cumulative_q[mask])
        return out

    def conditional_probability(self, tree: DraftTree) -> torch.Tensor:
        """[N] calibrated P(node's token is the target's argmax at its parent); root 1."""
        scores = tree.scores.double()
        q = torch.exp(scores - scores[tree.parents.clamp(min=0)]).numpy()
        probs = self.conditional_probability_of(q, tree.depths.numpy(), (tree.sibling_ranks == 0).numpy())
        probs[0] = 1.0
        return torch.from_numpy(probs)

    def path_probability(self, tree: DraftTree) -> torch.Tensor:
        """[N] calibrated P(node lies on the accepted path): product of conditional probabilities
        along its path (root 1). Non-increasing from parent to child."""
        return path_products(tree, self.conditional_probability(tree))

    def to_dict(self) -> dict:
        out = {
            "max_depth_bucket": self.max_depth_bucket,
            "conditional": [m.to_dict() for m in self.conditional],
            "path": [m.to_dict() for m in self.path],
        }
        if self.top_conditional is not None:
            out["top_conditional"] = [m.to_dict() for m in self.top_conditional]
        return out

    @staticmethod
    def from_dict(data: dict) -> "AcceptanceCalibration":
        max_bucket = int(data["max_depth_bucket"])
        conditional = tuple(IsotonicMap.from_dict(m) for m in data["conditional"])
        path = tuple(IsotonicMap.from_dict(m) for m in data["path"])
        top = tuple(IsotonicMap.from_dict(m) for m in data["top_conditional"]) if "top_conditional" in data else None
        if len(conditional) != max_bucket or len(path) != max_bucket or (top is not None and len(top) != max_bucket):
            raise ValueError(f"calibration needs {max_bucket} maps per kind")
        return AcceptanceCalibration(conditional, path, max_bucket, top)


def path_products(tree: DraftTree, conditional: torch.Tensor) -> torch.Tensor:
    """[N] product of `conditional` ([N], root 1) along each node's path, one depth level at a time."""
    out = conditional.clone()
    depths, parents = tree.depths, tree.parents
    for depth in range(1, int(depths.max()) + 1):
        level = depths == depth
        out[level] = out[parents[level]] * conditional[level]
    return out


def expected_calibration_error(predicted: np.ndarray, observed: np.ndarray, bins: int = 10) -> float:
    """Sum over equal-width probability bins of (bin share) * |mean predicted - observed rate|."""
    if len(predicted) == 0:
        return float("nan")
    index = np.minimum((np.asarray(predicted) * bins).astype(int), bins - 1)
    error = 0.0
    for b in range(bins):
        mask = index == b
        if mask.any():
            error += mask.mean() * abs(predicted[mask].mean() - observed[mask].astype(np.float64).mean())
    return float(error)


@dataclass(frozen=True)
class CalibrationReport:
    nodes: int
    steps: int
    folds: int
    raw_conditional_ece: float  # raw conditional q vs conditional acceptance, nodes whose parent was reached
    calibrated_conditional_ece: float  # cross-fitted, same nodes
    raw_path_ece: float  # raw cumulative q vs on-path
    calibrated_path_ece: float  # cross-fitted product of conditionals vs on-path
    direct_path_ece: float  # cross-fitted direct path map vs on-path
    raw_sum_per_step: float  # mean over steps of sum of raw cumulative q over drafted nodes
    calibrated_sum_per_step: float  # same, cross-fitted calibrated path probabilities (product)
    direct_sum_per_step: float  # same, cross-fitted direct path map
    accepted_per_step: float  # mean accepted drafted nodes per step (bonus excluded), same steps

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def cross_fitted_report(
    steps: Sequence[StepRecord],
    groups: Sequence[int] | None = None,
    folds: int = 5,
    max_depth_bucket: int = 4,
    min_bucket_samples: int = 50,
) -> CalibrationReport:
    """Reliability of the calibration, each fold predicted by maps fitted on the others; `steps`
    and `groups` as in `NodeSamples.from_steps`."""
    samples = NodeSamples.from_steps(steps, groups)
    groups = np.unique(samples.group)
    # fold by prompt when there are enough prompts (steps of one prompt are correlated), else by step
    unit = samples.group if len(groups) >= folds else samples.step
    fold_of = unit % folds
    conditional = np.full(len(samples), np.nan)
    direct = np.full(len(samples), np.nan)
    path_product = np.full(len(samples), np.nan)
    for fold in range(folds):
        test = fold_of == fold
        train = ~test
        if not test.any() or not train.any():
            continue
        calibration = AcceptanceCalibration.fit(samples.subset(train), max_depth_bucket, min_bucket_samples)
        top = samples.top[test] if samples.top is not None else None
        conditional[test] = calibration.conditional_probability_of(samples.conditional_q[test], samples.depth[test], top)
        direct[test] = calibration.direct_path_probability_of(samples.cumulative_q[test], samples.depth[test])
        for index in np.unique(samples.step[test]):
            probs = calibration.path_probability(steps[index].tree())[1:].numpy()
            path_product[samples.step == index] = probs
    valid = ~np.isnan(conditional)
    s = samples.subset(valid)
    steps_valid = np.unique(s.step)
    r = s.parent_reached
    nan = float("nan")

    def per_step_sum(values: np.ndarray) -> float:
        return float(np.mean([values[s.step == i].sum() for i in steps_valid])) if len(steps_valid) else nan

    return CalibrationReport(
        nodes=len(s),
        steps=len(steps),
        folds=folds,
        raw_conditional_ece=expected_calibration_error(s.conditional_q[r], s.conditional_accepted[r]),
        calibrated_conditional_ece=expected_calibration_error(conditional[valid][r], s.conditional_accepted[r]),
        raw_path_ece=expected_calibration_error(s.cumulative_q, s.on_path),
        calibrated_path_ece=expected_calibration_error(path_product[valid], s.on_path),
        direct_path_ece=expected_calibration_error(direct[valid], s.on_path),
        raw_sum_per_step=per_step_sum(s.cumulative_q),
        calibrated_sum_per_step=per_step_sum(path_product[valid]),
        direct_sum_per_step=per_step_sum(direct[valid]),
        accepted_per_step=per_step_sum(s.on_path.astype(np.float64)),
    )

