"""The fit of an engine's measured step times (`integrations/vllm/step_costs.py`), without an engine:
it recovers a known price, never prices a term below zero, and its file is read back or refused by
name. The engine itself is run in tests/vllm."""

import json

import numpy as np
import pytest

from moe_spec.errors import InputError
from moe_spec.integrations.vllm.step_costs import TERMS, EngineCosts, EngineStep, _terms, fit
from moe_spec.measure.store import DEFAULT_PROFILE
from moe_spec.policy.engine_schedule import schedule
from moe_spec.profile.artifact import Profile


@pytest.fixture(scope="module")
def profile():
    return Profile.load(DEFAULT_PROFILE)


def _samples(profile, coefficients, grid=((1, 4, 16), (0, 1, 2, 3))):
    return [EngineStep(rows, k, float(np.dot(coefficients, _terms(profile, rows, k))), 10)
            for rows in grid[0] for k in grid[1]]


def test_the_fit_recovers_the_price_the_steps_were_made_with(profile):
    truth = (3.0, 0.05, 0.02, 1.5, 0.1, 0.7)
    costs = fit(profile, _samples(profile, truth))
    assert costs.coefficients == pytest.approx(truth, rel=1e-6)
    price = costs.step_cost(profile)
    assert price(8, 2) == pytest.approx(float(np.dot(truth, _terms(profile, 8, 2))))


def test_no_term_is_priced_below_zero_and_a_costly_draft_means_no_speculation(profile):
    # every drafted depth costs 40 ms in this engine, far more than a step of it makes back
    samples = [EngineStep(s.rows, s.length, s.ms_per_step - 0.5 * s.rows * s.length, 10)
               for s in _samples(profile, (2.0, 0.01, 0.0, 40.0, 0.6, 0.0))]
    costs = fit(profile, samples)
    assert min(costs.coefficients) >= 0 and costs.coefficients[TERMS.index("draft_per_depth_ms")] > 30
    choices = schedule(profile, [0.6, 0.4, 0.3], 16, costs.step_cost(profile))
    assert {choice.length for choice in choices} == {0}


def test_the_costs_file_round_trips_and_a_broken_one_is_refused_by_name(profile, tmp_path):
    costs = fit(profile, _samples(profile, (3.0, 0.05, 0.02, 1.5, 0.1, 0.7)))
    path = tmp_path / "engine_costs.json"
    path.write_text(json.dumps(costs.to_dict()))
    assert EngineCosts.load(path) == costs
    document = costs.to_dict()
    document["per_token_ms"] = -1.0
    path.write_text(json.dumps(document))
    with pytest.raises(InputError, match="coefficient"):
        EngineCosts.load(path)
    path.write_text("{}")
    with pytest.raises(InputError, match="engine costs"):
        EngineCosts.load(path)
    with pytest.raises(InputError, match="at least two"):
        fit(profile, [EngineStep(1, 0, 5.0, 10)])
