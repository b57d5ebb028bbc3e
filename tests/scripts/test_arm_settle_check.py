"""`scripts/arm_settle_check.py` times each arm of the bound offloaded, counting its rate after the
settling steps, over every step and over the whole request."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("arm_settle_check", ROOT / "scripts" / "arm_settle_check.py")
arm_settle_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(arm_settle_check)

PROMPTS = str(ROOT / "configs/bench/smoke.jsonl")


def test_each_arm_counts_every_step_and_skips_only_the_settling_ones(tmp_path):
    result = arm_settle_check.main(["--prompts", PROMPTS, "--limit", "2", "--arms", "plain,static:2",
                                    "--max-new-tokens", "12", "--resident-experts", "8",
                                    "--offload-dir", str(tmp_path / "store")])
    assert set(result["rates_per_ms"]) == {"plain", "static:2"}
    plain = result["tokens"]["plain"]
    assert plain["request"] == 2 * 12, "each request's new tokens, its prefill's first one among them"
    assert plain["steps"] == 2 * 11, "a plain step makes one token"
    assert plain["settled"] == 2 * (11 - arm_settle_check.SETTLE_STEPS)
    drafted = result["tokens"]["static:2"]
    assert drafted["settled"] < drafted["steps"] == 2 * 11
    for ways in result["rates_per_ms"].values():
        assert all(rate > 0 for rate in ways.values())
        assert ways["request"] < ways["steps"], "the request's time holds its prefill"


@pytest.mark.parametrize("argv, message", [(["--arms", "static:x"], "--arms: unknown arm"),
                                           (["--max-new-tokens", "4"], "--max-new-tokens")])
def test_unknown_arms_and_too_few_tokens_are_refused(argv, message):
    with pytest.raises(SystemExit, match=message):
        arm_settle_check.main(["--prompts", PROMPTS, *argv])
