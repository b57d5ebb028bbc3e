"""`price_checks` and `scripts/price_check.py`: the profile's verify price against a bench's passes."""

import importlib.util
import json
from pathlib import Path

import pytest

from moe_spec.experiments.price_check import price_checks
from moe_spec.profile.cost_model import CostModel

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("price_check_script", ROOT / "scripts" / "price_check.py")
script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(script)

MODEL = CostModel(base_ms=10.0, per_token_ms=0.5, per_expert_ms=(0.25,), num_layers=4)


def _methods() -> dict:
    return {"ar": {"mean_tree_size": 0.0, "unique_experts_per_layer": 2.0, "verify_ms": 8.0},
            "static:4": {"mean_tree_size": 4.0, "unique_experts_per_layer": 6.0, "verify_ms": 20.0},
            "nothing": {"mean_tree_size": 0.0, "unique_experts_per_layer": 0.0, "verify_ms": 0.0}}


def test_each_method_is_priced_at_its_mean_tokens_and_experts():
    checks = {check.method: check for check in price_checks(MODEL, _methods())}
    assert set(checks) == {"ar", "static:4"}  # no verify time: nothing to compare
    assert checks["ar"].priced_ms == pytest.approx(10.0 + 0.5 * 1 + 0.25 * 2 * 4)  # 12.5 against 8
    assert checks["ar"].ratio == pytest.approx(12.5 / 8.0)
    assert checks["static:4"].priced_ms == pytest.approx(10.0 + 0.5 * 5 + 0.25 * 6 * 4)  # 18.5 against 20
    assert checks["static:4"].ratio < 1.0


def test_the_script_prints_each_row_and_a_final_json_line(tmp_path, capsys):
    (tmp_path / "profile.json").write_text(json.dumps({"cost_model": MODEL.to_dict()}))
    (tmp_path / "bench.json").write_text(json.dumps({"methods": _methods(), "config": {"batch_size": 1}}))
    assert script.main([str(tmp_path / "profile.json"), str(tmp_path / "bench.json"), "--json", str(tmp_path / "o.json")]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    final = json.loads(lines[-1])
    assert [row["method"] for row in final["rows"]] == ["ar", "static:4"]
    assert final["rows"][0]["priced_over_measured"] == pytest.approx(1.5625)
    assert json.loads((tmp_path / "o.json").read_text()) == final["rows"]


@pytest.mark.parametrize("config", [{"batch_size": 4}, {"batch_size": 1, "offload": {"tier": "disk"}}])
def test_the_script_refuses_a_bench_whose_passes_the_profile_does_not_price(tmp_path, capsys, config):
    (tmp_path / "profile.json").write_text(json.dumps({"cost_model": MODEL.to_dict()}))
    (tmp_path / "bench.json").write_text(json.dumps({"methods": _methods(), "config": config}))
    assert script.main([str(tmp_path / "profile.json"), str(tmp_path / "bench.json")]) == 2
    assert "does not price" in capsys.readouterr().err


def test_the_sweep_model_is_priced_on_request_and_refused_where_there_is_none(tmp_path, capsys):
    sweep = CostModel(base_ms=12.0, per_token_ms=0.5, per_expert_ms=(0.25,), num_layers=4)
    document = {"cost_model": MODEL.to_dict(), "details": {"cost_model_report": {"loop_alignment": {"sweep_model": sweep.to_dict()}}}}
    (tmp_path / "profile.json").write_text(json.dumps(document))
    (tmp_path / "bench.json").write_text(json.dumps({"methods": _methods(), "config": {"batch_size": 1}}))
    assert script.main([str(tmp_path / "profile.json"), str(tmp_path / "bench.json"), "--sweep-model"]) == 0
    final = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert final["rows"][0]["priced_ms"] == pytest.approx(14.5)  # the sweep's 12 ms fixed part, not the profile's 10
    (tmp_path / "profile.json").write_text(json.dumps({"cost_model": MODEL.to_dict()}))
    assert script.main([str(tmp_path / "profile.json"), str(tmp_path / "bench.json"), "--sweep-model"]) == 2
    assert "no loop alignment" in capsys.readouterr().err
