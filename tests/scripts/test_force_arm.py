"""`scripts/force_arm.py` runs the bench with `moe-aware`'s bound held to one arm."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("force_arm", ROOT / "scripts" / "force_arm.py")
force_arm = importlib.util.module_from_spec(spec)
spec.loader.exec_module(force_arm)


@pytest.mark.parametrize("arm", ["plain", "static:2"])
def test_the_bound_held_to_one_arm_decides_every_step_by_it_and_stays_lossless(arm, tmp_path):
    out = tmp_path / "bench.json"
    assert force_arm.main([arm, "--", "--prompts", str(ROOT / "configs/bench/smoke.jsonl"), "--limit", "1",
                           "--methods", "ar,moe-aware", "--max-new-tokens", "8", "--warmup-tokens", "0",
                           "--no-progress", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["decisions"]["moe-aware"] == {arm: 1.0}
    assert report["methods"]["moe-aware"]["mismatches"] == 0
    from moe_spec.policy.registry import METHODS
    assert METHODS["moe-aware"] is not None and "held_to" not in repr(METHODS["moe-aware"].build), "restored"


def test_an_unknown_arm_is_refused():
    with pytest.raises(SystemExit, match="unknown arm 'static:x'"):
        force_arm.main(["static:x", "--", "--prompts", str(ROOT / "configs/bench/smoke.jsonl"), "--limit", "1",
                        "--methods", "moe-aware", "--max-new-tokens", "4", "--warmup-tokens", "0", "--no-progress"])
