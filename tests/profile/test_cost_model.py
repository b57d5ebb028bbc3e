import math

import numpy as np
import pytest
import torch

from moe_spec.profile.cost_model import CostModel, CostSample, expected_unique_experts, r_squared, relative_errors
from moe_spec.core.tree import DraftTree


def _synthetic(base, per_token, per_expert, num_layers, noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    samples = []
    for tokens in (1, 2, 4, 8, 16, 32, 64):
        for _ in range(4):
            unique = tuple(int(u) for u in rng.integers(2, 64, size=num_layers))
            ms = base + per_token * tokens + float(np.dot(np.broadcast_to(per_expert, (num_layers,)), unique))
            samples.append(CostSample(tokens, unique, ms * (1 + noise * rng.standard_normal())))
    return samples


def test_fit_recovers_known_coefficients_exactly():
    model = CostModel.fit(_synthetic(20.5, 0.22, 0.0343, num_layers=8))
    assert model.base_ms == pytest.approx(20.5, rel=1e-6)
    assert model.per_token_ms == pytest.approx(0.22, rel=1e-6)
    assert model.per_expert_ms == pytest.approx((0.0343,), rel=1e-6)


def test_fit_recovers_known_coefficients_from_noisy_timings():
    samples = _synthetic(35.6, 0.45, 0.596, num_layers=8, noise=0.02, seed=1)
    model = CostModel.fit(samples)
    assert model.base_ms == pytest.approx(35.6, rel=0.15)
    assert model.per_token_ms == pytest.approx(0.45, rel=0.25)
    assert model.per_expert_ms[0] == pytest.approx(0.596, rel=0.05)
    assert np.median(relative_errors(model, samples)) < 0.03
    assert r_squared(model, samples) > 0.95


def test_per_layer_fit_recovers_per_layer_expert_costs():
    per_expert = np.array([0.1, 0.2, 0.05, 0.3])
    model = CostModel.fit(_synthetic(5.0, 0.1, per_expert, num_layers=4), per_layer=True)
    assert model.per_layer
    assert model.per_expert_ms == pytest.approx(tuple(per_expert), rel=1e-6)
    assert model.base_ms == pytest.approx(5.0, rel=1e-6)


def test_predict_ms_is_the_formula():
    model = CostModel(base_ms=10.0, per_token_ms=0.5, per_expert_ms=(0.25,), num_layers=2)
    assert model.predict_ms(4, [3, 5]) == pytest.approx(10.0 + 0.5 * 4 + 0.25 * 8)
    per_layer = CostModel(base_ms=1.0, per_token_ms=0.0, per_expert_ms=(1.0, 2.0), num_layers=2)
    assert per_layer.predict_ms(7, [3, 5]) == pytest.approx(1.0 + 3 + 10)
    with pytest.raises(ValueError):
        model.predict_ms(4, [3])


def test_predict_on_a_tree_counts_unique_experts():
    tree = DraftTree.from_lists([5, 6, 7], [-1, 0, 0])
    onehot = torch.zeros(2, 3, 8)  # [L, N, E]
    onehot[0, 0, [0, 1]] = 1
    onehot[0, 1, [1, 2]] = 1
    onehot[0, 2, [0, 2]] = 1  # layer 0: experts {0, 1, 2}
    onehot[1, :, [4, 5]] = 1  # layer 1: experts {4, 5}
    model = CostModel(base_ms=1.0, per_token_ms=0.1, per_expert_ms=(1.0,), num_layers=2)
    assert model.predict(tree, onehot) == pytest.approx(1.0 + 0.3 + 5.0)
    with pytest.raises(ValueError):
        model.predict(tree, onehot[:, :2])


def test_expected_unique_experts_with_probabilities():
    p = torch.tensor([[[0.5, 0.0], [0.5, 1.0]]])  # [L=1, N=2, E=2]
    # expert 0: 1 - 0.5 * 0.5 = 0.75; expert 1: 1 - 1 * 0 = 1
    assert expected_unique_experts(p).tolist() == pytest.approx([1.75])


def test_json_round_trip_and_validation():
    model = CostModel(base_ms=3.0, per_token_ms=0.2, per_expert_ms=(0.1, 0.2, 0.3), num_layers=3)
    assert CostModel.from_dict(model.to_dict()) == model
    with pytest.raises(ValueError):
        CostModel(base_ms=1.0, per_token_ms=0.1, per_expert_ms=(0.1, 0.2), num_layers=3)
    with pytest.raises(ValueError):
        CostModel(base_ms=math.nan, per_token_ms=0.1, per_expert_ms=(0.1,), num_layers=3)
    with pytest.raises(ValueError):
        CostModel.fit([])


def test_dense_target_has_no_expert_term():
    samples = [CostSample(t, (), 2.0 + 0.5 * t) for t in (1, 2, 4, 8)]
    model = CostModel.fit(samples)
    assert model.num_layers == 0
    assert model.predict_ms(10, []) == pytest.approx(7.0)


def test_fit_keeps_coefficients_nonnegative():
    # timings that fall slightly with U: least squares would give a negative expert cost
    samples = [CostSample(t, (u, u), 5.0 + 0.1 * t - 0.001 * u) for t in (1, 4, 16) for u in (2, 4, 8)]
    model = CostModel.fit(samples)
    assert model.per_expert_ms == (0.0,)
    assert model.per_token_ms == pytest.approx(0.1, rel=0.05)


def _batched_synthetic(base, per_row, per_token, per_expert, num_layers, rows_counts, seed=0):
    rng = np.random.default_rng(seed)
    samples = []
    for rows in rows_counts:
        for tokens in (1, 4, 16, 64):
            for _ in range(3):
                total = rows * tokens
                unique = tuple(int(u) for u in rng.integers(2, 64, size=num_layers))
                ms = base + per_row * (rows - 1) + per_token * total + per_expert * sum(unique)
                samples.append(CostSample(total, unique, ms, rows))
    return samples


def test_fit_recovers_the_per_row_cost_from_passes_of_several_row_counts():
    model = CostModel.fit(_batched_synthetic(11.4, 2.5, 0.26, 0.042, num_layers=8, rows_counts=(1, 2, 4, 8)))
    assert model.per_row_ms == pytest.approx(2.5, rel=1e-6)
    assert model.base_ms == pytest.approx(11.4, rel=1e-6)
    assert model.per_token_ms == pytest.approx(0.26, rel=1e-6)
    assert model.per_expert_ms == pytest.approx((0.042,), rel=1e-6)


def test_one_row_count_leaves_the_row_term_out_of_the_fit():
    # B is constant: its column would be collinear with the intercept, so base absorbs it
    for rows in (1, 4):
        model = CostModel.fit(_batched_synthetic(11.4, 2.5, 0.26, 0.042, num_layers=8, rows_counts=(rows,)))
        assert model.per_row_ms == 0.0
        assert model.base_ms == pytest.approx(11.4 + 2.5 * (rows - 1), rel=1e-6)
        assert model.per_token_ms == pytest.approx(0.26, rel=1e-6)


def test_the_row_term_counts_rows_after_the_first():
    model = CostModel(base_ms=10.0, per_token_ms=0.5, per_expert_ms=(0.25,), num_layers=2, per_row_ms=3.0)
    assert model.predict_ms(4, [3, 5]) == pytest.approx(10.0 + 0.5 * 4 + 0.25 * 8)
    assert model.predict_ms(4, [3, 5], rows=4) == pytest.approx(10.0 + 3.0 * 3 + 0.5 * 4 + 0.25 * 8)
    with pytest.raises(ValueError):
        model.predict_ms(4, [3, 5], rows=0)
    assert CostModel.from_dict(model.to_dict()) == model
    older = {k: v for k, v in model.to_dict().items() if k != "per_row_ms"}  # a profile from before the row term
    assert CostModel.from_dict(older).per_row_ms == 0.0
    sample = CostSample(4, (3, 5), 10.0 + 9.0 + 2.0 + 2.0, rows=4)
    assert relative_errors(model, [sample]) == pytest.approx([0.0])
