"""`scripts/batch_breakdown.py` splits each method's batched decoding time by kind of step."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("batch_breakdown", ROOT / "scripts" / "batch_breakdown.py")
batch_breakdown = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = batch_breakdown  # its dataclass looks its module up
spec.loader.exec_module(batch_breakdown)


def test_the_split_covers_the_decoding_and_checks_the_controllers_model(capsys):
    assert batch_breakdown.main(["--prompts", str(ROOT / "configs/bench/smoke.jsonl"), "--limit", "3",
                                 "--batch-size", "3", "--max-new-tokens", "8", "--passes", "2"]) == 0
    report = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert set(report["methods"]) == set(batch_breakdown.METHODS)
    for name, figures in report["methods"].items():
        covered = figures["full_batch_share"] + figures["tail_share"] + figures["prefill_share"]
        assert 0.8 < covered <= 1.0 + 1e-6, f"{name}: steps and prefill are nearly all of the time"
    assert report["methods"]["ar"]["plain_steps"] == 1.0
    mine = report["methods"]["moe-aware"]
    assert mine.get("checked_steps", 0) > 0, "moe-aware speculated on some full-batch step, and the check ran on it"
    assert mine["produced_tokens"] >= 3 * mine["checked_steps"], "every row makes a token a step"


def test_one_pass_is_refused():
    with pytest.raises(ValueError, match="passes"):
        batch_breakdown.breakdown(None, None, None, [], 2, 4, passes=1)
