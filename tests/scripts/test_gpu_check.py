"""scripts/gpu_check.sh --tiny on the CPU: every step the device run takes succeeds and writes its files."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.sh"
STEPS = ("env", "tests", "olmoe", "embedded", "simulate", "qwen3", "offload")
FILES = ("env.json", "tests.xml", "profile_olmoe.json", "profile_olmoe.npz", "profile_embedded.json",
         "profile_embedded.npz", "simulate_gpu.json", "profile_qwen3.json", "profile_olmoe_offload.json", "summary.json")


@pytest.mark.slow
def test_the_tiny_gpu_check_runs_every_step_on_the_cpu(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "MOE_SPEC_WORK": str(tmp_path / "work")}
    env.pop("MOE_SPEC_WHEELS", None)
    done = subprocess.run(["bash", str(SCRIPT), str(out), "--tiny"], env=env, capture_output=True, text=True,
                          timeout=900)
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert done.returncode == 0 and summary["ok"], f"failed steps {summary['failed']}:\n{done.stderr[-3000:]}"
    assert summary["tiny"] and list(summary["steps"]) == list(STEPS)
    for name in FILES + tuple(f"{step}.log" for step in STEPS):
        assert (out / name).is_file(), name
    assert not (out / "tiny-olmoe").exists(), "the random model is scratch, not a result"
    simulated = json.loads((out / "simulate_gpu.json").read_text())
    assert simulated["simulation"] is True
    assert simulated["results"][0]["cost_model"]["source"] == "profile profile_embedded.json"
    assert {"moe-aware", "static-best", "truncate", "eagle2"} <= set(simulated["results"][0]["policies"])
    embedded = json.loads((out / "profile_embedded.json").read_text())
    assert embedded["fingerprint"]["model_type"] == "deepseek_v3" and embedded["cost_model"]["num_layers"] == 8
    profile = json.loads((out / "profile_olmoe.json").read_text())
    assert profile["fingerprint"]["model_type"] == "olmoe"
    offloaded = json.loads((out / "profile_olmoe_offload.json").read_text())
    assert offloaded["cost_model"]["fetch"] is not None


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("megablocks") is not None, reason="megablocks is installed here")
def test_a_failed_step_is_recorded_and_the_next_steps_still_run(tmp_path):
    """Without megablocks, asking for it fails the profiling steps with the clear error; the steps that
    need their profile fail as such, and the summary names every failed step."""
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "MOE_SPEC_WORK": str(tmp_path / "work"), "MOE_SPEC_EXPERTS": "megablocks"}
    done = subprocess.run(["bash", str(SCRIPT), str(out), "--tiny"], env=env, capture_output=True, text=True,
                          timeout=900)
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert done.returncode == 1 and not summary["ok"]
    assert summary["failed"] == ["olmoe", "embedded", "simulate", "qwen3", "offload"]
    assert summary["steps"]["tests"]["rc"] == 0
    assert "needs the megablocks package" in (out / "olmoe.log").read_text()
    assert "needs step embedded" in (out / "simulate.log").read_text()
    assert json.loads((out / "summary.json").read_text())["steps"][-1]["step"] == "offload"
