"""`scripts/bandit_prior_sim.py`: simulated runs of the bandit by the error (the weight) of its prior (the figures
docs/measurements.md cites come from it)."""

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bandit_prior_sim", ROOT / "scripts" / "bandit_prior_sim.py")
bandit_prior_sim = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bandit_prior_sim)


def test_a_heavier_prior_loses_less_when_it_ranks_right_and_more_when_it_swaps_the_best(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bandit_prior_sim.py", "--prior-error", "0.25,0.125", "--exploration", "0.7",
                                      "--seeds", "8", "--steps", "200", "--prior-noise", "0.03", "--swap", "0.15",
                                      "--adjust", "0"])
    bandit_prior_sim.main()
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("SIMULATION")
    result = json.loads(out[-1])
    assert result["simulation"] is True
    light, heavy = result["rows"]
    assert (light["prior_error"], heavy["prior_error"]) == (0.25, 0.125)
    assert heavy["noisy"]["mean"] < light["noisy"]["mean"]
    assert heavy["swap"]["mean"] > light["swap"]["mean"]
    assert all(0.0 <= row[case]["mean"] <= 0.2 for row in result["rows"] for case in ("noisy", "swap"))


def test_the_swapped_prior_ranks_the_runs_second_arm_first():
    rates, prior = bandit_prior_sim.rates_and_prior("swap", 0, 0.0, 0.1)
    assert max(rates, key=rates.get) == "chain:2" and max(prior, key=prior.get) == "chain:1"
    rates, prior = bandit_prior_sim.rates_and_prior("noisy", 3, 0.05, 0.1)
    assert rates == bandit_prior_sim.ARMS and all(abs(prior[a] / rates[a] - 1) <= 0.05 for a in rates)


def test_adjusting_to_the_steps_references_loses_less_than_judging_each_arm_on_its_own_requests(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bandit_prior_sim.py", "--prior-error", "0.25", "--exploration", "0.7",
                                      "--seeds", "12", "--steps", "250", "--adjust", "0,1"])
    bandit_prior_sim.main()
    unadjusted, adjusted = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    assert (unadjusted["adjust"], adjusted["adjust"]) == (False, True)
    for case in ("noisy", "swap"):
        assert adjusted[case]["mean"] < unadjusted[case]["mean"], case


def test_the_chain_simulation_loses_less_with_references(monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("bandit_reference_sim", ROOT / "scripts" / "bandit_reference_sim.py")
    reference_sim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reference_sim)
    assert reference_sim.chain_tokens([0.5, 0.5, 0.5], 2) == 1.75
    monkeypatch.setattr(sys, "argv", ["bandit_reference_sim.py", "--seeds", "12"])
    reference_sim.main()
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("SIMULATION")
    unadjusted, adjusted = json.loads(out[-1])["rows"]
    assert (unadjusted["adjust"], adjusted["adjust"]) == (False, True)
    assert adjusted["mean"] < unadjusted["mean"]
    assert all(abs(sum(row["decided"].values()) - 1) < 0.01 for row in (unadjusted, adjusted))


def test_the_tilt_case_loses_less_with_the_arms_tokens_and_the_others_little_more(monkeypatch, capsys):
    rates, prior = bandit_prior_sim.rates_and_prior("tilt", 0, 0.0, 0.1, -0.4)
    assert prior == bandit_prior_sim.ARMS and rates["plain"] == prior["plain"] and rates["chain:6"] < 0.75 * prior["chain:6"]
    monkeypatch.setattr(sys, "argv", ["bandit_prior_sim.py", "--prior-error", "0.25", "--exploration", "0.7",
                                      "--seeds", "12", "--steps", "250", "--adjust", "1", "--tilt", "0,1"])
    bandit_prior_sim.main()
    flat, tilted = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    assert (flat["tilted"], tilted["tilted"]) == (False, True)
    assert tilted["tilt"]["mean"] < flat["tilt"]["mean"]
    assert tilted["noisy"]["mean"] < 1.25 * flat["noisy"]["mean"] + 0.005
