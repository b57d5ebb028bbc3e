"""`scripts/fetch_price_fit.py` decodes offloaded with several arms and fits what each pass's compute
and reads cost against the profile's prices, on one half of the requests, scored on the other."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("fetch_price_fit", ROOT / "scripts" / "fetch_price_fit.py")
fetch_price_fit = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fetch_price_fit)


def test_the_fits_recover_known_prices():
    rng = np.random.default_rng(0)
    c, f = rng.uniform(10, 20, 200), rng.choice([0.0, 2.0, 8.0, 20.0], 200)
    m = 1.2 * c + 1.9 * f
    assert fetch_price_fit.fit_two(c, f, m) == pytest.approx((1.2, 1.9))
    assert fetch_price_fit.fit_one(c, np.zeros(200), 1.5 * c) == pytest.approx(1.5)
    assert fetch_price_fit.median_error(m, m) == 0.0


def test_a_run_fits_both_ways_and_scores_on_the_other_requests(tmp_path):
    out = tmp_path / "fit.json"
    assert fetch_price_fit.main(["--limit", "2", "--arms", "plain,static:2", "--max-new-tokens", "12",
                                 "--offload-dir", str(tmp_path / "store"), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["fitted_on"] > 0 and report["scored_on"] > 0
    assert report["fitted_on"] + report["scored_on"] == report["passes"]
    for fit in ("one_scale", "two_scales"):
        assert 0 <= report[fit]["held_out_median_error"] < 10
    assert set(report["online"]) == {"profile price", "memory 0.9", "memory 0.95", "memory 0.98"}
    assert report["online"]["profile price"]["final_fetch_scale"] == 1.0
    for row in report["online"].values():
        assert 0.25 <= row["final_fetch_scale"] <= 4.0 and 0.25 <= row["final_scale"] <= 4.0
        assert 0 <= row["median_error"] < 10
