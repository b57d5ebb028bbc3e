"""`scripts/sampling_cost.py` times the nucleus and the draw both ways on the target's own logits."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("sampling_cost", ROOT / "scripts" / "sampling_cost.py")
sampling_cost = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sampling_cost)


def test_both_ways_are_timed_and_their_masks_agree(capsys):
    assert sampling_cost.main(["--prompts", str(ROOT / "configs/bench/smoke.jsonl"), "--rows", "12",
                               "--repeats", "1"]) == 0
    report = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert report["rows"] == 12 and report["mismatched_masks"] == 0
    for key in ("probabilities_us", "probabilities_sorted_us", "sample_us", "multinomial_us"):
        assert report[key] > 0
