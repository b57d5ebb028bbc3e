import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from moe_spec.profile.cost_model import CostModel
from moe_spec.profile.artifact import SCHEMA_VERSION, ExpertPricing, Profile, ProfileError, fingerprint, hardware_description
from moe_spec.profile.calibration import AcceptanceCalibration, IsotonicMap
from moe_spec.profile.expert_table import TokenExpertTable
from moe_spec.profile.unique_curve import UniqueExpertsCurve
from moe_spec.loading import ASSETS
from moe_spec.core.target import TargetModel
from moe_spec.testing.tiny_models import tiny_model
from moe_spec.core.tree import DraftTree


@pytest.fixture(scope="module")
def model():
    return tiny_model("mixtral", num_hidden_layers=2)


def _profile(model, pricing: ExpertPricing = ExpertPricing.TOPK) -> Profile:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 96, (50,), generator=generator)
    experts = torch.stack([torch.stack([torch.randperm(8, generator=generator)[:2] for _ in range(50)]) for _ in range(2)])
    token_totals = np.bincount(tokens.numpy(), minlength=96)  # [V]
    token_counts = np.zeros((96, 2, 8), dtype=np.int64)  # [V, L, E]
    for layer in range(2):
        for t, token in enumerate(tokens.tolist()):
            token_counts[token, layer, experts[layer, t]] += 1
    load = token_counts.sum(axis=0)  # [L, E]
    iso = IsotonicMap((0.1, 0.5, 0.9), (0.2, 0.5, 0.8), 100)
    curve = UniqueExpertsCurve((1, 2, 4), np.array([[2.0, 2.0], [3.5, 3.0], [np.nan, np.nan]]), (9, 5, 0),
                               np.array([[2.0, 2.0], [3.8, 3.7], [6.0, 6.1]]))
    return Profile(
        fingerprint=fingerprint(model),
        hardware=hardware_description(),
        cost_model=CostModel(3.0, 0.1, (0.05,), num_layers=2, per_row_ms=0.7),
        calibration=AcceptanceCalibration((iso, iso), (iso, iso), 2),
        expert_table=TokenExpertTable.from_counts(token_totals, token_counts, load, top_k=2),
        expert_pricing=pricing,
        unique_experts_curve=curve,
        details={"note": "test", "nan_becomes_null": float("nan"), "routing": {"tokens": 50},
                 "expert_predictor": {"node_recall": [0.5, 0.4]}},
        arrays={"routing_load": load},
    )


def _same(first: Profile, second: Profile) -> bool:
    """Every typed section and every summary equal (the expert table by its stored counts)."""
    tables = (first.expert_table is None) == (second.expert_table is None)
    if first.expert_table is not None and second.expert_table is not None:
        a, b = first.expert_table.arrays(), second.expert_table.arrays()
        tables = a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
        tables = tables and first.expert_table.pseudo_count == second.expert_table.pseudo_count
    return (tables and first.fingerprint == second.fingerprint and first.hardware == second.hardware
            and first.cost_model == second.cost_model and first.calibration == second.calibration
            and first.expert_pricing == second.expert_pricing and first.unique_experts_curve == second.unique_experts_curve
            and first.details == second.details and first.arrays.keys() == second.arrays.keys()
            and all(np.array_equal(first.arrays[k], second.arrays[k]) for k in first.arrays))


def _as_schema_2(document: dict) -> dict:
    """A schema-3 document laid out as schema 2 wrote it: the pricing form (with the predictor's kind)
    in details["expert_predictor"], the curve in details["routing"]."""
    document = json.loads(json.dumps(document))
    section = document["expert_predictor"]
    details = document["details"]
    details["expert_predictor"] = {"kind": section.pop("kind"), "pricing": section.pop("pricing"),
                                   **details.get("expert_predictor", {})}
    details.setdefault("routing", {})["unique_experts_curve"] = document.pop("unique_experts_curve")
    document["schema_version"] = 2
    return document


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
    assert loaded.expert_pricing is ExpertPricing.TOPK and loaded.unique_experts_curve == profile.unique_experts_curve
    assert _same(loaded, replace(profile, details={**profile.details, "nan_becomes_null": None}))
    tree = DraftTree.from_lists([3, 4, 5], [-1, 0, 1], [0.0, -0.5, -1.0])
    assert torch.equal(loaded.priced_experts(tree.tokens), profile.expert_table.predict_onehot(tree))
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


def test_a_schema_2_profile_loads_as_the_same_typed_profile(tmp_path, model):
    path = tmp_path / "p.json"
    _profile(model).save(path)
    current = Profile.load(path, target=model)
    old = tmp_path / "old.json"
    old.write_text(json.dumps(_as_schema_2(json.loads(path.read_text()))))
    migrated = Profile.load(old, target=model)
    assert migrated.schema_version == 2 and "unique_experts_curve" not in migrated.details["routing"]
    assert _same(migrated, current)


def test_a_schema_2_profile_without_a_pricing_form_prices_probabilities(tmp_path, model):
    path = tmp_path / "p.json"
    _profile(model).save(path)
    document = _as_schema_2(json.loads(path.read_text()))
    del document["details"]["expert_predictor"]["pricing"]
    path.write_text(json.dumps(document))
    loaded = Profile.load(path, target=model)
    tree = DraftTree.from_lists([3, 4, 5], [-1, 0, 1], [0.0, -0.5, -1.0])
    assert loaded.expert_pricing is ExpertPricing.PROBABILITIES
    assert torch.equal(loaded.priced_experts(tree.tokens), loaded.expert_table.predict(tree))


def test_the_shipped_profile_is_schema_3_and_reads_back_as_schema_2_identically(tmp_path):
    shipped = ASSETS / "default_profile.json"
    document = json.loads(shipped.read_text())
    assert document["schema_version"] == SCHEMA_VERSION == 3
    old = tmp_path / "default_profile.json"
    old.write_text(json.dumps(_as_schema_2(document)))
    (tmp_path / "default_profile.npz").write_bytes(shipped.with_suffix(".npz").read_bytes())
    current = Profile.load(shipped)
    assert current.expert_pricing is not None and current.unique_experts_curve is not None
    assert _same(Profile.load(old), current)


def test_a_profile_prices_experts_exactly_when_it_has_a_table(model):
    with pytest.raises(ValueError, match="exactly when"):
        replace(_profile(model), expert_pricing=None)
    with pytest.raises(ValueError):
        replace(_profile(model), expert_pricing="sets")


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
        (lambda text: _edit(text, lambda d: d["expert_predictor"].update(pricing="sets")), "malformed.*sets"),
        (lambda text: _edit(text, lambda d: d["expert_predictor"].update(kind="head")), "unknown expert predictor kind"),
        (lambda text: _edit(text, lambda d: d["unique_experts_curve"].update(sizes=[4, 2, 1])), "malformed.*increasing"),
        (lambda text: _edit(text, lambda d: d["unique_experts_curve"].update(real=[[1.0], [2.0], [3.0]])), "malformed"),
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


def test_the_weights_hash_samples_in_bounds_past_float32s_exact_integers():
    """2**25 + 4 elements: a float32 linspace puts its last position at 2**25 + 4, one past the end
    (OLMoE-1B-7B's expert tensors hit this on the GPU); the sample ends at the last element."""
    from moe_spec.profile.artifact import hash_sample

    size = 2**25 + 4
    assert int(torch.linspace(0, size - 1, 4096).long()[-1]) == size  # what the clamp is for
    tensor = torch.arange(size, dtype=torch.int32)
    sample = hash_sample(tensor)
    assert sample.shape == (4096,) and int(sample[0]) == 0 and int(sample[-1]) == size - 1
    small = torch.arange(5000, dtype=torch.int32)
    assert torch.equal(hash_sample(small), small[torch.linspace(0, 4999, 4096).long()])
    assert torch.equal(hash_sample(small[:100]), small[:100])
