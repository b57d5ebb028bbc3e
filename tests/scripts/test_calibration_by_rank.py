"""`scripts/calibration_by_rank.py` tabulates acceptance of first children and later siblings."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # decodes with the embedded pair

ROOT = Path(__file__).resolve().parents[2]


def test_the_table_separates_first_children_from_later_siblings():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "calibration_by_rank.py"), "--prompts",
                           str(ROOT / "configs" / "bench" / "profile.jsonl"), "--max-prompts", "3"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    line = json.loads(done.stdout.strip().splitlines()[-1])
    assert line["prompts"] == 3 and {r["first_child"] for r in line["rows"]} == {True, False}
    for row in line["rows"]:
        assert row["nodes"] >= 5 and 0.0 <= row["accepted"] <= 1.0 and 0.0 <= row["profile"] <= 1.0
