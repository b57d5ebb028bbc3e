import json

import numpy as np
import pytest
import torch

from moe_spec.profile.cost_model import CostModel
from moe_spec.profile.artifact import SCHEMA_VERSION, Profile, ProfileError, fingerprint, hardware_description
from moe_spec.profile.calibration import AcceptanceCalibration, IsotonicMap
from moe_spec.profile.expert_table import TokenExpertTable
from moe_spec.measure.routing_stats import RoutingStats
from moe_spec.core.target import TargetModel
from moe_spec.testing.tiny_models import tiny_model
from moe_spec.core.tree import DraftTree


@pytest.fixture(scope="module")
def model():
    return tiny_model("mixtral", num_hidden_layers=2)


def _profile(model) -> Profile:
    stats = RoutingStats(vocab_size=96, num_layers=2, num_experts=8, top_k=2)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 96, (50,), generator=generator)
    experts = torch.stack([torch.stack([torch.randperm(8, generator=generator)[:2] for _ in range(50)]) for _ in range(2)])
    stats.add(tokens, experts)
    iso = IsotonicMap((0.1, 0.5, 0.9), (0.2, 0.5, 0.8), 100)
    return Profile(
        fingerprint=fingerprint(model),
        hardware=hardware_description(),
        cost_model=CostModel(3.0, 0.1, (0.05,), num_layers=2, per_row_ms=0.7),
        calibration=AcceptanceCalibration((iso, iso), (iso, iso), 2),
        expert_table=TokenExpertTable.from_stats(stats),
        details={"note": "test", "nan_becomes_null": float("nan")},
        arrays={"routing_load": stats.load},
    )


def test_round_trip(tmp_path, model):
    profile = _profile(model)
    profile.save(tmp_path / "p.json")
    loaded = Profile.load(tmp_path / "p.json", target=model)
    assert loaded.schema_version == SCHEMA_VERSION
    assert loaded.cost_model == profile.cost_model
    assert loaded.calibration == profile.calibration
    assert loaded.fingerprint == profile.fingerprint
    assert loaded.details["note"] == "test" and loaded.details["nan_becomes_null"] is None
    assert np.array_equal(loaded.arrays["routing_load"], profile.arrays["routing_load"])
    tree = DraftTree.from_lists([3, 4, 5], [-1, 0, 1], [0.0, -0.5, -1.0])
    assert torch.allclose(loaded.predicted_experts(tree), profile.predicted_experts(tree))
    assert loaded.predict_verify_ms(tree) == pytest.approx(profile.predict_verify_ms(tree))
    assert torch.allclose(loaded.calibrated_path_probability(tree), profile.calibrated_path_probability(tree))
    json.loads((tmp_path / "p.json").read_text())  # strict JSON: no NaN
    Profile.load(tmp_path / "p.json", target=TargetModel(model))


def test_a_version_1_profile_without_a_row_term_still_loads(tmp_path, model):
    _profile(model).save(tmp_path / "p.json")
    document = json.loads((tmp_path / "p.json").read_text())
    document["schema_version"] = 1
    del document["cost_model"]["per_row_ms"]
    (tmp_path / "p.json").write_text(json.dumps(document))
    loaded = Profile.load(tmp_path / "p.json", target=model)
    assert loaded.schema_version == 1
    assert loaded.cost_model.per_row_ms == 0.0
    assert loaded.cost_model.predict_ms(4, [2, 2], rows=3) == pytest.approx(3.0 + 0.1 * 4 + 0.05 * 4)


def test_fingerprint_is_stable_and_sees_weight_changes(model):
    first = fingerprint(model)
    assert fingerprint(model) == first
    assert first["model_type"] == "mixtral" and first["num_experts"] == 8 and first["top_k"] == 2
    other = tiny_model("mixtral", num_hidden_layers=2, seed=1)
    assert fingerprint(other)["weights_sha256"] != first["weights_sha256"]


def test_rejects_a_profile_for_another_target(tmp_path, model):
    _profile(model).save(tmp_path / "p.json")
    with pytest.raises(ProfileError, match="another target.*weights_sha256"):
        Profile.load(tmp_path / "p.json", target=tiny_model("mixtral", num_hidden_layers=2, seed=1))
    with pytest.raises(ProfileError, match="model_type"):
        Profile.load(tmp_path / "p.json", target=tiny_model("qwen3_moe", num_hidden_layers=2))
    with pytest.raises(ProfileError, match="dtype"):
        Profile.load(tmp_path / "p.json", target=tiny_model("mixtral", num_hidden_layers=2, dtype=torch.bfloat16))


def test_rejects_a_newer_schema(tmp_path, model):
    path = tmp_path / "p.json"
    _profile(model).save(path)
    document = json.loads(path.read_text())
    document["schema_version"] = SCHEMA_VERSION + 1
    path.write_text(json.dumps(document))
    with pytest.raises(ProfileError, match="newer"):
        Profile.load(path)


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda text: text[: len(text) // 2], "not valid JSON"),
        (lambda text: "", "not valid JSON"),
        (lambda text: "[1, 2]", "not a JSON object"),
        (lambda text: json.dumps({"fingerprint": {}}), "schema_version"),
        (lambda text: _edit(text, lambda d: d.pop("cost_model")), "cost_model"),
        (lambda text: _edit(text, lambda d: d["cost_model"].pop("base_ms")), "malformed.*base_ms"),
        (lambda text: _edit(text, lambda d: d["cost_model"].update(per_expert_ms=[1, 2, 3])), "malformed"),
        (lambda text: _edit(text, lambda d: d["calibration"]["conditional"][0].update(y=[1.0, 0.5, 0.2])), "malformed"),
        (lambda text: _edit(text, lambda d: d["arrays"].update(sha256="0" * 64)), "checksum"),
        (lambda text: _edit(text, lambda d: d["arrays"].update(file="missing.npz")), "cannot be read"),
    ],
)
def test_rejects_corrupt_files_with_a_clear_error(tmp_path, model, corrupt, message):
    path = tmp_path / "p.json"
    _profile(model).save(path)
    path.write_text(corrupt(path.read_text()))
    with pytest.raises(ProfileError, match=message):
        Profile.load(path)


def test_rejects_a_missing_file_and_a_corrupt_sidecar(tmp_path, model):
    with pytest.raises(ProfileError, match="cannot read"):
        Profile.load(tmp_path / "nothing.json")
    path = tmp_path / "p.json"
    sidecar = _profile(model).save(path)
    sidecar.write_bytes(sidecar.read_bytes()[:100])
    with pytest.raises(ProfileError, match="checksum"):
        Profile.load(path)


def _edit(text: str, change) -> str:
    document = json.loads(text)
    change(document)
    return json.dumps(document)
