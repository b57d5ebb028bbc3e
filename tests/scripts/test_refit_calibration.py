"""`scripts/refit_calibration.py` refits the shipped profile's greedy calibration and keeps the rest."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from moe_spec.measure.store import DEFAULT_PROFILE

pytestmark = pytest.mark.slow  # decodes with the embedded pair

ROOT = Path(__file__).resolve().parents[2]


def test_the_refit_replaces_the_calibration_and_keeps_the_cost_model(tmp_path):
    out = tmp_path / "profile.json"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "refit_calibration.py"), "--profile", str(DEFAULT_PROFILE),
                           "--prompts", str(ROOT / "configs" / "bench" / "profile.jsonl"), "--max-prompts", "2",
                           "--out", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    line = json.loads(done.stdout.strip().splitlines()[-1])
    shipped, refit = json.loads(Path(DEFAULT_PROFILE).read_text()), json.loads(out.read_text())
    assert refit["cost_model"] == shipped["cost_model"] and refit["head_routing"] == shipped["head_routing"]
    assert refit["details"]["calibration"] == line["calibration"] != shipped["details"]["calibration"]  # 2 prompts' steps
    assert len(refit["calibration"]["top_conditional"]) == refit["calibration"]["max_depth_bucket"]
    assert (tmp_path / "profile.npz").is_file()
