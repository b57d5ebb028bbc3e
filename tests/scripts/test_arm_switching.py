"""`scripts/arm_switching.py` runs the bench with `moe-aware`'s bound held to a rota of two arms."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("arm_switching", ROOT / "scripts" / "arm_switching.py")
arm_switching = importlib.util.module_from_spec(spec)
spec.loader.exec_module(arm_switching)

BENCH = ["--prompts", str(ROOT / "configs/bench/smoke.jsonl"), "--limit", "1", "--max-new-tokens", "12",
         "--warmup-tokens", "0", "--no-progress"]


def test_each_rota_switches_arms_every_block_steps_and_stays_lossless(tmp_path):
    out = tmp_path / "bench.json"
    assert arm_switching.main(["plain", "static:2", "--blocks", "1,4", "--", *BENCH, "--methods", "ar",
                               "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    for name in ("rota-1", "rota-4"):
        assert set(report["decisions"][name]) == {"plain", "static:2"}, report["decisions"][name]
        assert report["methods"][name]["mismatches"] == 0
    from moe_spec.policy.registry import METHODS
    assert "rota-1" not in METHODS and "rota-4" not in METHODS, "restored"


def test_the_rota_bandit_plays_each_arm_for_its_block():
    bandit = arm_switching.RotaBandit(("a", "b"), block=3)
    assert [bandit.choose(None) for _ in range(8)] == ["a", "a", "a", "b", "b", "b", "a", "a"]


@pytest.mark.parametrize("argv, message", [(["plain", "static:x", "--"], "unknown arm 'static:x'"),
                                           (["plain", "static:2", "--blocks", "0", "--"], "--blocks")])
def test_unknown_arms_and_empty_blocks_are_refused(argv, message):
    with pytest.raises(SystemExit, match=message):
        arm_switching.main([*argv, *BENCH])
