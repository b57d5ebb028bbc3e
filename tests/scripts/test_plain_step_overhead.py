"""`scripts/plain_step_overhead.py` times the parts of a plain step under `ar` and under the bound held to plain."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("plain_step_overhead", ROOT / "scripts" / "plain_step_overhead.py")
plain_step_overhead = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plain_step_overhead)

ARGS = ["--prompts", str(ROOT / "configs/bench/smoke.jsonl"), "--limit", "2", "--max-new-tokens", "8", "--repeats", "1"]


def test_both_ways_decode_plainly_and_every_part_is_timed():
    report = plain_step_overhead.main(ARGS + ["--temperature", "1"])
    # the prefill makes the first token, then one a step; the first step (after the prefill) is left
    # out: 6 steps a request
    assert report["steps"] == {"ar": 12, "bound, plain": 12}
    for way, parts in report["mean_ms"].items():
        assert set(parts) == set(plain_step_overhead.PARTS) and all(ms >= 0 for ms in parts.values()), way
        assert parts["verify_ms"] > 0 and report["total_ms"][way] == pytest.approx(sum(parts.values()))
    assert report["mean_ms"]["bound, plain"]["draft_ms"] < report["mean_ms"]["bound, plain"]["verify_ms"] / 10, \
        "held to plain, the bound drafts nothing"


def test_the_gap_runs_from_a_steps_end_to_the_next_ones_start():
    class Record:
        def __init__(self, started, step_ms):
            self.started, self.step_ms = started, step_ms
            self.verify_ms, self.accept_ms, self.plan_ms, self.draft_ms = step_ms, 0.0, 0.0, 0.0

    parts = plain_step_overhead.step_parts([Record(1.000, 4.0), Record(1.005, 3.0), Record(1.010, 2.0)])
    assert [p.get("gap_ms") for p in parts] == [pytest.approx(1.0), pytest.approx(2.0), None]


@pytest.mark.parametrize("flag", ["--limit", "--max-new-tokens", "--repeats"])
def test_nothing_to_time_is_refused_by_name(flag):
    argv = [a for a in ARGS]
    argv[argv.index(flag) + 1] = "0"
    with pytest.raises(SystemExit):
        plain_step_overhead.main(argv)
