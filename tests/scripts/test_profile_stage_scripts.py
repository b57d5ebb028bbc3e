"""The scripts that add one profile stage to an existing profile (`scripts/profile_arm_rates.py`,
`scripts/profile_sampling.py`) write it into a copy and keep every other section; and
`scripts/fuzz_inputs.py` fuzzes a few combinations without a failure."""

import importlib.util
import json
from pathlib import Path

import pytest

from moe_spec.core.target import TargetModel
from moe_spec.loading import load_target
from moe_spec.profile.artifact import Profile

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PROFILE = ROOT / "moe_spec/assets/default_profile.json"
PROMPTS = str(ROOT / "configs/bench/smoke.jsonl")


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def target():
    return TargetModel(load_target(None))


def _last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_arm_rates_are_measured_into_a_copy_and_the_other_entries_kept(tmp_path, target, capsys):
    out = tmp_path / "profile.json"
    before = Profile.load(DEFAULT_PROFILE, target)
    assert _script("profile_arm_rates").main(["--profile", str(DEFAULT_PROFILE), "--out", str(out), "--prompts", PROMPTS,
                                              "--settings", "temperature=0", "--max-prompts", "1",
                                              "--max-new-tokens", "32"]) == 0
    report = _last_json(capsys)
    after = Profile.load(out, target)
    greedy = [e for e in after.arm_rates if e.sampling.greedy and e.rows == 1 and e.resident_experts is None]
    assert len(greedy) == 1 and {"plain", "sized"} <= set(greedy[0].rates), greedy
    assert report["arm_rates"] == [greedy[0].to_dict()]
    kept = [e for e in before.arm_rates if not (e.sampling.greedy and e.rows == 1)]
    assert all(e in after.arm_rates for e in kept), "the entries of other settings are kept"
    assert after.cost_model == before.cost_model


def test_sampling_acceptance_is_measured_into_a_copy(tmp_path, target, capsys):
    out = tmp_path / "profile.json"
    assert _script("profile_sampling").main(["--profile", str(DEFAULT_PROFILE), "--out", str(out), "--prompts", PROMPTS,
                                             "--settings", "1.0", "--max-prompts", "1", "--max-new-tokens", "8"]) == 0
    report = _last_json(capsys)
    after = Profile.load(out, target)
    assert [(e.temperature, e.sampled, e.steps) for e in after.sampling_acceptance] == [
        (e["temperature"], e["sampled"], e["steps"]) for e in report["entries"]]
    assert {e.sampled for e in after.sampling_acceptance} == {True, False}, "both candidate schemes"
    assert all(e.steps > 0 for e in after.sampling_acceptance)
    assert after.cost_model == Profile.load(DEFAULT_PROFILE, target).cost_model


def test_a_negative_sampled_chain_is_refused_before_anything_loads(tmp_path):
    with pytest.raises(SystemExit):
        _script("profile_sampling").main(["--profile", str(tmp_path / "absent.json"), "--prompts", PROMPTS,
                                          "--settings", "1.0", "--sampled-chain", "-1"])


def test_a_few_fuzzed_combinations_fail_nothing(capsys):
    assert _script("fuzz_inputs").main(["--engine-cases", "30", "--drop-in-cases", "15"]) == 0
    report = _last_json(capsys)
    assert report["combinations"] == 45 and report["failures"] == 0 and report["distinct_messages"] > 0


def test_the_head_routing_predictor_is_fitted_into_a_copy(tmp_path, target, capsys):
    out = tmp_path / "profile.json"
    line = _script("fit_head_routing").main(["--profile", str(DEFAULT_PROFILE), "--prompts",
                                             str(ROOT / "configs/bench/profile.jsonl"), "--max-new-tokens", "8",
                                             "--out", str(out)])
    assert _last_json(capsys) == line
    after, before = Profile.load(out, target), Profile.load(DEFAULT_PROFILE, target)
    assert after.head_routing.keeps.value == line["keeps"] in ("head", "token_table")
    assert 0 < line["union_f1_head"] <= 1 and 0 < line["union_f1_table"] <= 1
    assert after.cost_model == before.cost_model and after.arm_rates == before.arm_rates
