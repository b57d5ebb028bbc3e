"""`scripts/read_ahead_table.py`: misses and exposed read time per token, without and with read-ahead."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("read_ahead_table", ROOT / "scripts" / "read_ahead_table.py")
read_ahead_table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(read_ahead_table)


def _report(wait_ms: float, misses: float, offloaded: bool = True) -> dict:
    figures = {"mean_accept_len": 2.0, "misses_per_token": misses, "fetch_wait_ms": wait_ms, "speedup_vs_ar": 1.1}
    return {"config": {"offload": "disk" if offloaded else None}, "methods": {"moe-aware": figures, "ar": figures}}


def test_the_exposed_read_time_is_per_token_and_each_method_is_a_row(tmp_path):
    text, figures = read_ahead_table.table(_report(8.0, 10.0), _report(5.0, 12.0))
    assert figures["moe-aware"]["without"]["wait_ms"] == pytest.approx(4.0)  # 8 ms a step of 2 tokens
    assert figures["moe-aware"]["with"] == {"misses": 12.0, "wait_ms": 2.5, "speedup": 1.1}
    assert "| moe-aware | 10.0 / 12.0 | 4.00 / 2.50 | 1.10x / 1.10x |" in text.splitlines()
    assert "ar" not in figures, "plain decoding reads no drafts: not a row"


def test_reports_that_are_not_offloaded_are_refused(tmp_path):
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    paths[0].write_text(json.dumps(_report(1.0, 1.0)))
    paths[1].write_text(json.dumps(_report(1.0, 1.0, offloaded=False)))
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "read_ahead_table.py"), *map(str, paths)],
                          capture_output=True, text=True)
    assert done.returncode != 0 and "offloaded" in done.stderr
