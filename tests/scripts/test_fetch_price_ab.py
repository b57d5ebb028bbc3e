"""`scripts/fetch_price_ab.py` benches the sizing at the profile's fetch price beside the registry's
methods, offloaded, and its output stays the target's own."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("fetch_price_ab", ROOT / "scripts" / "fetch_price_ab.py")
fetch_price_ab = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fetch_price_ab)


def test_the_sizing_at_the_profiles_price_is_benched_beside_the_registrys_methods(tmp_path):
    out = tmp_path / "ab.json"
    methods = f"ar,moe-aware-unbounded,{fetch_price_ab.SIZING_AT_PROFILE_PRICE}"
    assert fetch_price_ab.main(["--config", str(ROOT / "configs" / "bench_offload.yaml"), "--offload-dir",
                                str(tmp_path / "store"), "--limit", "1", "--max-new-tokens", "8", "--warmup-tokens", "0",
                                "--methods", methods, "--no-progress", "--json", str(out)]) == 0
    results = json.loads(out.read_text())["methods"]
    assert set(results) == set(methods.split(","))
    assert all(result["mismatches"] == 0 for result in results.values())
    assert fetch_price_ab.SIZING_AT_PROFILE_PRICE not in fetch_price_ab.registry.METHODS, "registered for the call only"
