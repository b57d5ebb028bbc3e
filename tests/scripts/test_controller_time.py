"""`scripts/controller_time.py` times a controller's plan and observe inside decoding."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("controller_time", ROOT / "scripts" / "controller_time.py")
controller_time = importlib.util.module_from_spec(spec)
spec.loader.exec_module(controller_time)


def test_every_step_of_a_batch_is_timed(capsys):
    assert controller_time.main(["--batch-size", "2", "--limit", "2", "--max-new-tokens", "6"]) == 0
    report = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert report["batch_size"] == 2 and report["prompts"] == 2 and report["steps"] >= 1
    assert report["plan_us"] > 0 and report["observe_us"] > 0
    assert 0 < report["plan_share"] < report["controller_share"] < 1


def test_a_method_without_a_controller_is_refused():
    with pytest.raises(SystemExit):
        controller_time.main(["--method", "ar", "--limit", "1"])
