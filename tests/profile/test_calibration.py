import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from moe_spec.profile.calibration import (
    AcceptanceCalibration,
    IsotonicMap,
    NodeSamples,
    cross_fitted_report,
    expected_calibration_error,
    isotonic_regression,
)
from moe_spec.core.acceptance import Acceptance
from moe_spec.core.forest import StepForest
from moe_spec.core.routing import Routing
from moe_spec.core.step_record import StepRecord
from moe_spec.core.tree import DraftTree


def test_pav_pools_violators_into_weighted_means():
    knots_x, knots_y = isotonic_regression(np.array([1, 2, 3, 4, 5.0]), np.array([1, 3, 2, 4, 3.5]))
    assert knots_y.tolist() == pytest.approx([1.0, 2.5, 3.75])
    assert knots_x.tolist() == pytest.approx([1.0, 2.5, 4.5])


def test_pav_matches_scipy():
    scipy_optimize = pytest.importorskip("scipy.optimize")
    rng = np.random.default_rng(0)
    for _ in range(20):
        x = np.sort(rng.random(40))
        y = (rng.random(40) < x).astype(float)
        weight = rng.uniform(0.5, 2.0, 40)
        reference = scipy_optimize.isotonic_regression(y, weights=weight).x  # per point, x already sorted
        knots_x, knots_y = isotonic_regression(x, y, weight)
        blocks = [np.flatnonzero(np.isclose(reference, value)) for value in knots_y]
        assert np.unique(reference.round(12)).tolist() == pytest.approx(knots_y.tolist())
        for value, members, knot in zip(knots_y, blocks, knots_x):
            assert np.average(x[members], weights=weight[members]) == pytest.approx(knot)


def test_ties_in_x_are_pooled():
    knots_x, knots_y = isotonic_regression(np.array([1.0, 1.0, 1.0, 1.0]), np.array([0, 1, 1, 0.0]))
    assert knots_x.tolist() == [1.0] and knots_y.tolist() == [0.5]


def test_isotonic_map_round_trip_and_validation():
    m = IsotonicMap.fit(np.array([0.1, 0.5, 0.9]), np.array([0.0, 1.0, 1.0]))
    assert IsotonicMap.from_dict(m.to_dict()) == m
    assert m(np.array([0.0, 1.0])).tolist() == [0.0, 1.0]
    with pytest.raises(ValueError):
        IsotonicMap.from_dict({"x": [0.2, 0.1], "y": [0.0, 1.0], "samples": 2})


def test_ece_by_hand():
    predicted = np.array([0.05, 0.05, 0.95, 0.95])
    observed = np.array([0, 0, 1, 0])
    # bin 0: |0.05 - 0| * 0.5; bin 9: |0.95 - 0.5| * 0.5
    assert expected_calibration_error(predicted, observed) == pytest.approx(0.025 + 0.225)


def _record(tree: DraftTree, experts: torch.Tensor, argmax: torch.Tensor, path: list[int], num_experts: int = 8) -> StepRecord:
    """A one-row step record verifying `tree` in full; experts: [L, N, K], argmax: [N]."""
    routing = Routing(tuple(range(experts.shape[0])), num_experts if experts.shape[0] else 0, experts)
    acceptance = Acceptance(list(path), int(argmax[path[-1]]))
    return StepRecord((0,), (0,), (tree,), StepForest((tree,)), (acceptance,), argmax[None], routing, 1.0, 0.1)


def _synthetic_steps(n_steps: int, seed: int) -> tuple[list[StepRecord], list[int]]:
    """Chains of depth 3 with conditional draft probability q; the target accepts with rate q**2."""
    rng = np.random.default_rng(seed)
    steps = []
    for index in range(n_steps):
        q = rng.uniform(0.05, 1.0, size=3)
        scores = np.concatenate([[0.0], np.cumsum(np.log(q))])
        accepted = rng.random(3) < q**2
        tree = DraftTree.from_lists([10, 11, 12, 13], [-1, 0, 1, 2], scores.tolist())
        argmax = torch.tensor([11 if accepted[0] else 0, 12 if accepted[1] else 0, 13 if accepted[2] else 0, 0])
        path = [0]
        for node in (1, 2, 3):
            if not accepted[node - 1]:
                break
            path.append(node)
        steps.append(_record(tree, torch.zeros(0, 4, 0, dtype=torch.long), argmax, path))
    return steps, [index % 7 for index in range(n_steps)]  # the steps and the prompt each came from


def test_calibration_learns_the_acceptance_curve_and_beats_raw_probabilities():
    steps, groups = _synthetic_steps(3000, seed=0)
    calibration = AcceptanceCalibration.fit(NodeSamples.from_steps(steps, groups))
    q = np.array([0.2, 0.5, 0.9])
    for depth in (1, 2, 3):
        predicted = calibration.conditional_probability_of(q, np.full(3, depth))
        assert predicted == pytest.approx(q**2, abs=0.08)
    report = cross_fitted_report(steps, groups)
    assert report.calibrated_conditional_ece < 0.05 < report.raw_conditional_ece
    assert report.calibrated_path_ece < report.raw_path_ece
    assert report.calibrated_sum_per_step == pytest.approx(report.accepted_per_step, rel=0.1)


def test_path_probability_is_the_product_along_the_path():
    steps, _ = _synthetic_steps(500, seed=1)
    calibration = AcceptanceCalibration.fit(NodeSamples.from_steps(steps), min_bucket_samples=10)
    tree = DraftTree.from_lists([1, 2, 3, 4], [-1, 0, 1, 0], np.log([1.0, 0.8, 0.4, 0.1]).tolist())
    conditional = calibration.conditional_probability(tree)
    path = calibration.path_probability(tree)
    assert path[0] == 1.0 and conditional[0] == 1.0
    assert path[2] == pytest.approx(float(conditional[1] * conditional[2]))
    assert path[3] == pytest.approx(float(conditional[3]))
    assert bool((path[2] <= path[1]))
    assert AcceptanceCalibration.from_dict(calibration.to_dict()) == calibration


def test_fit_needs_nodes():
    with pytest.raises(ValueError, match="no drafted nodes"):
        AcceptanceCalibration.fit(NodeSamples.from_steps([]))


def test_samples_label_the_records_nodes_and_reject_batched_records():
    tree = DraftTree.from_lists([10, 11, 12, 13], [-1, 0, 1, 0], np.log([1.0, 0.5, 0.25, 0.4]).tolist())
    argmax = torch.tensor([11, 0, 0, 0])  # the target takes node 1 at the root, then nothing
    samples = NodeSamples.from_steps([_record(tree, torch.zeros(0, 4, 0, dtype=torch.long), argmax, [0, 1])], [3])
    assert samples.on_path.tolist() == [True, False, False]
    assert samples.conditional_accepted.tolist() == [True, False, False]
    assert samples.parent_reached.tolist() == [True, True, True]
    assert samples.conditional_q.tolist() == pytest.approx([0.5, 0.5, 0.4])
    assert samples.group.tolist() == [3, 3, 3]
    one = _record(tree, torch.zeros(0, 4, 0, dtype=torch.long), argmax, [0, 1])
    two = StepRecord((0, 1), (0, 0), (tree, tree), StepForest((tree, tree)), one.acceptances * 2,
                     torch.stack([argmax, argmax]), one.routing, 1.0, 0.1)
    with pytest.raises(ValueError, match="one-row"):
        NodeSamples.from_steps([two])


def _sibling_steps(n_steps: int, seed: int) -> list[StepRecord]:
    """The root's two children, the first with q in [0.02, 0.1] and the second just below it: the
    target takes the first 45% of the time, the second 5% (as the embedded head's first children
    of a spread distribution are taken far above their q)."""
    rng = np.random.default_rng(seed)
    steps = []
    for _ in range(n_steps):
        q = rng.uniform(0.02, 0.1)
        tree = DraftTree.from_lists([10, 11, 12], [-1, 0, 0], [0.0, float(np.log(q)), float(np.log(q * 0.99))])
        draw = rng.random()
        taken = 11 if draw < 0.45 else 12 if draw < 0.5 else 0
        steps.append(_record(tree, torch.zeros(0, 3, 0, dtype=torch.long), torch.tensor([taken, 0, 0]),
                             [0, 1] if taken == 11 else [0, 2] if taken == 12 else [0]))
    return steps


def test_a_parents_first_child_is_calibrated_apart_from_its_siblings():
    steps = _sibling_steps(2000, seed=3)
    samples = NodeSamples.from_steps(steps)
    assert samples.top.tolist()[:2] == [True, False]  # ranked by score among siblings
    calibration = AcceptanceCalibration.fit(samples)
    q = np.full(4, 0.06)
    first = calibration.conditional_probability_of(q, np.ones(4), np.ones(4, dtype=bool))
    later = calibration.conditional_probability_of(q, np.ones(4), np.zeros(4, dtype=bool))
    assert first == pytest.approx(0.45, abs=0.08) and later == pytest.approx(0.05, abs=0.04)
    pooled = AcceptanceCalibration.fit(replace(samples, top=None))  # ranks unknown: one map, in between
    assert pooled.top_conditional is None
    assert later[0] + 0.1 < pooled.conditional_probability_of(q, np.ones(4))[0] < first[0] - 0.1
    tree = steps[0].tree()
    assert calibration.conditional_probability(tree)[1:].tolist() == pytest.approx(
        [calibration.conditional_map(1, True).at(math.exp(float(tree.scores[1]))),
         calibration.conditional_map(1).at(math.exp(float(tree.scores[2])))])
    assert AcceptanceCalibration.from_dict(calibration.to_dict()) == calibration
    old = {key: value for key, value in calibration.to_dict().items() if key != "top_conditional"}
    assert AcceptanceCalibration.from_dict(old).top_conditional is None  # a profile fitted before ranks: still read
    report = cross_fitted_report(steps)  # cross-fitted with the ranks: near the truth
    assert report.calibrated_conditional_ece < 0.05


def test_sibling_ranks_follow_scores_for_top_candidates_and_draws_for_sampled_ones():
    tree = DraftTree.from_lists([1, 2, 3, 4, 5, 6], [-1, 0, 0, 1, 0, 1], [0.0, -2.0, -1.0, -2.5, -1.0, -3.0])
    assert tree.sibling_ranks.tolist() == [0, 2, 0, 0, 1, 1]  # ties to the lower index
    sampled = DraftTree(tree.tokens, tree.parents, tree.scores, torch.ones(6, 2) / 2, torch.tensor([0, 1]),
                        torch.tensor([0, 0, 1, 0, 2, 1]))
    assert sampled.sibling_ranks.tolist() == [0, 0, 1, 0, 2, 1]
