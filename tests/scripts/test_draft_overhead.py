"""`scripts/draft_overhead.py` times one candidate tree drafted four ways and checks they are the same trees."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("draft_overhead", ROOT / "scripts" / "draft_overhead.py")
draft_overhead = importlib.util.module_from_spec(spec)
spec.loader.exec_module(draft_overhead)


def test_four_ways_of_drafting_are_timed(capsys):
    assert draft_overhead.main(["--batch-size", "2", "--nodes", "4", "--depth", "2", "--repeats", "2"]) == 0
    report = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert report["batch_size"] == 2 and report["repeats"] == 2
    assert set(report["ms"]) == {"plain", "features", "pricer", "both"} and min(report["ms"].values()) > 0
    assert report["pricer_ms"] == pytest.approx(report["ms"]["pricer"] - report["ms"]["plain"], abs=1e-3)


def test_bad_sizes_are_refused():
    with pytest.raises(SystemExit):
        draft_overhead.main(["--depth", "0"])
    with pytest.raises(SystemExit):
        draft_overhead.main(["--batch-size", "1000"])
