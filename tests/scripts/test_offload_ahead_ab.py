"""`scripts/offload_ahead_ab.py` decodes each arm under each reading mode, offloaded, and reports
what each read and waited for."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("offload_ahead_ab", ROOT / "scripts" / "offload_ahead_ab.py")
offload_ahead_ab = importlib.util.module_from_spec(spec)
spec.loader.exec_module(offload_ahead_ab)


def test_every_arm_is_measured_under_every_mode_and_only_reads_ahead_read_ahead(tmp_path):
    out = tmp_path / "ab.json"
    assert offload_ahead_ab.main(["--limit", "1", "--arms", "plain,static:2", "--max-new-tokens", "24",
                                  "--offload-dir", str(tmp_path / "store"), "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert set(results) == {f"{arm}/{mode}" for arm in ("plain", "static:2") for mode in offload_ahead_ab.MODES}
    for arm in ("plain", "static:2"):
        assert results[f"{arm}/on-demand"]["read_ahead_used"] is None, "nothing read ahead on demand"
        assert results[f"{arm}/on-demand"]["step_rate_ratio"] == 1.0
        assert 0 < results[f"{arm}/layer-ahead"]["read_ahead_used"] <= 1
        assert results[f"{arm}/layer-ahead"]["misses_per_token"] >= results[f"{arm}/on-demand"]["misses_per_token"] * 0.5
    assert results["static:2/prefetch"]["read_ahead_used"] is not None, "a 2-node tree's plan reads ahead"
