"""`scripts/bound_sweep.py` replays the bound's bandit on a greedy bench trace, per setting."""

import importlib.util
import json
from pathlib import Path

import pytest

from moe_spec.cli.main import main as cli_main

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bound_sweep", ROOT / "scripts" / "bound_sweep.py")
bound_sweep = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bound_sweep)


@pytest.fixture(scope="module")
def greedy_trace(tmp_path_factory):
    """A greedy trace of the embedded pair on two smoke prompts."""
    trace = tmp_path_factory.mktemp("bound_sweep") / "trace.jsonl"
    assert cli_main(["bench", "--prompts", str(ROOT / "configs/bench/smoke.jsonl"), "--limit", "2",
                     "--max-new-tokens", "16", "--warmup-tokens", "0", "--no-progress", "--methods", "ar",
                     "--trace", str(trace)]) == 0
    return trace


def test_each_setting_gets_a_row_of_ratios_to_the_best_arm(greedy_trace, capsys):
    bound_sweep.main(["--trace", str(greedy_trace), "--exploration", "0.35,0.7", "--window", "8",
                      "--seeds", "2", "--request-prior-steps", "none,16", "--prior"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["command"] == "bound_sweep" and report["simulation"] and report["prior"]
    rows = report["results"][str(greedy_trace)]
    assert [(r["exploration"], r["request_prior_steps"]) for r in rows] == [(0.35, None), (0.35, 16.0),
                                                                            (0.7, None), (0.7, 16.0)]
    for row in rows:
        # the bound chooses among the arms, so it cannot beat the best of them in hindsight by much
        # (the jitter can lift a choice a little above the unjittered best)
        assert 0 < row["min"] <= row["mean"] <= 1.1, row


def test_a_sampled_trace_is_refused(tmp_path):
    trace = tmp_path / "t1.jsonl"
    assert cli_main(["bench", "--prompts", str(ROOT / "configs/bench/smoke.jsonl"), "--limit", "1",
                     "--max-new-tokens", "8", "--warmup-tokens", "0", "--no-progress", "--methods", "ar",
                     "--temperature", "1", "--trace", str(trace)]) == 0
    with pytest.raises(SystemExit, match="a sampled trace"):
        bound_sweep.main(["--trace", str(trace)])
