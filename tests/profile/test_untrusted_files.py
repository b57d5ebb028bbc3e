"""A profile from elsewhere (JSON + .npz) is read as data: never unpickled, its array shapes checked
against its fingerprint before anything is decompressed or built, and every way it can be wrong is
a ProfileError naming the file and the problem."""

import hashlib
import io
import json
import os
import pickle
import zipfile

import numpy as np
import pytest
import torch

from moe_spec.core.target import TargetModel
from moe_spec.profile.artifact import ExpertPricing, Profile, ProfileError, fingerprint, hardware_description
from moe_spec.profile.cost_model import CostModel
from moe_spec.profile.expert_table import TokenExpertTable
from moe_spec.testing.tiny_models import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("olmoe")


@pytest.fixture
def saved(tmp_path, model):
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 3, (96, 2, 8))  # [V, L, E]
    load = counts.sum(axis=0)
    profile = Profile(fingerprint(model), hardware_description(), CostModel(3.0, 0.1, (0.05,), num_layers=2), None,
                      TokenExpertTable.from_counts(counts.sum(axis=(1, 2)) // 2, counts, load, top_k=2),
                      ExpertPricing.TOPK, arrays={"routing_load": load})
    path = tmp_path / "p.json"
    profile.save(path)
    return path


def _arrays(path) -> dict:
    with np.load(path.with_suffix(".npz")) as npz:
        return {k: npz[k] for k in npz.files}


def _write_sidecar(path, blob: bytes) -> None:
    """Replace the sidecar and record its checksum, as a consistent foreign pair would."""
    path.with_suffix(".npz").write_bytes(blob)
    document = json.loads(path.read_text())
    document["arrays"]["sha256"] = hashlib.sha256(blob).hexdigest()
    path.write_text(json.dumps(document))


def _npz(arrays: dict, allow_pickle: bool = False) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, array in arrays.items():
            with archive.open(name + ".npy", "w") as member:
                np.lib.format.write_array(member, np.asanyarray(array), allow_pickle=allow_pickle)
    return buffer.getvalue()


def _edit(path, change) -> None:
    document = json.loads(path.read_text())
    change(document)
    path.write_text(json.dumps(document))


def test_the_saved_profile_loads(saved, model):
    profile = Profile.load(saved, TargetModel(model))
    assert profile.expert_table.token_counts.shape[1:] == (2, 8)


def test_a_pickled_object_array_is_refused_without_being_unpickled(saved, tmp_path):
    class Bomb:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'ran'}",))

    arrays = _arrays(saved)
    arrays["routing_load"] = np.array([Bomb()], dtype=object)
    _write_sidecar(saved, _npz(arrays, allow_pickle=True))
    with pytest.raises(ProfileError, match="routing_load.*dtype object"):
        Profile.load(saved)
    assert not (tmp_path / "ran").exists()
    _write_sidecar(saved, pickle.dumps({"predictor_prior": np.zeros((2, 8))}))  # a pickle named .npz
    with pytest.raises(ProfileError, match="not a readable .npz"):
        Profile.load(saved)
    assert not (tmp_path / "ran").exists()


@pytest.mark.parametrize("name, array, named", [
    ("predictor_prior", np.zeros((3, 8)), "predictor_prior.*shape \\(3, 8\\)"),
    ("predictor_token_counts", np.zeros((5, 2, 7), dtype=np.uint16), "predictor_token_counts.*shape"),
    ("routing_load", np.zeros(16), "routing_load.*shape"),
    ("predictor_token_ids", np.arange(3), "disagree on the number of token ids"),
    ("predictor_token_ids", None, "lacks the expert table's predictor_token_ids"),
    ("predictor_prior", np.array(["a", "b"]), "predictor_prior.*not numbers"),
])
def test_arrays_that_do_not_fit_the_fingerprint_are_named(saved, name, array, named):
    arrays = _arrays(saved)
    if array is None:
        del arrays[name]
    else:
        arrays[name] = array
    _write_sidecar(saved, _npz(arrays))
    with pytest.raises(ProfileError, match=named) as info:
        Profile.load(saved)
    assert str(saved.with_suffix(".npz")) in str(info.value) or str(saved) in str(info.value)


@pytest.mark.parametrize("ids, named", [(lambda ids: ids + 1000, "distinct token ids"),
                                        (lambda ids: -ids - 1, "distinct token ids"),
                                        (lambda ids: np.zeros_like(ids), "distinct token ids")])
def test_token_ids_outside_the_vocabulary_or_repeated_are_named(saved, ids, named):
    arrays = _arrays(saved)
    arrays["predictor_token_ids"] = ids(arrays["predictor_token_ids"])
    _write_sidecar(saved, _npz(arrays))
    with pytest.raises(ProfileError, match=named):
        Profile.load(saved)


def test_a_member_declaring_a_huge_array_is_refused_before_it_is_decompressed(saved):
    arrays = _arrays(saved)
    blob = io.BytesIO()
    with zipfile.ZipFile(blob, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, array in arrays.items():
            with archive.open(name + ".npy", "w") as member:
                np.lib.format.write_array(member, array)
        with archive.open("routing_huge.npy", "w") as member:  # a 2 TB header over a few bytes
            np.lib.format.write_array_header_1_0(member, {"descr": "<f8", "fortran_order": False, "shape": (2**38,)})
            member.write(b"\0" * 64)
    _write_sidecar(saved, blob.getvalue())
    with pytest.raises(ProfileError, match="routing_huge.*larger than any"):
        Profile.load(saved)


def test_a_truncated_member_is_named(saved):
    arrays = _arrays(saved)
    blob = io.BytesIO()
    with zipfile.ZipFile(blob, "w") as archive:
        for name, array in arrays.items():
            with archive.open(name + ".npy", "w") as member:
                np.lib.format.write_array(member, array)
        raw = io.BytesIO()
        np.lib.format.write_array(raw, arrays["predictor_prior"])
        archive.writestr("routing_cut.npy", raw.getvalue()[:-8])
    _write_sidecar(saved, blob.getvalue())
    with pytest.raises(ProfileError, match="not a readable .npz.*ends after"):
        Profile.load(saved)


@pytest.mark.parametrize("content", [b"", os.urandom(4096), b"PK\x03\x04" + os.urandom(200)])
def test_random_bytes_as_the_sidecar_are_named(saved, content):
    _write_sidecar(saved, content)
    with pytest.raises(ProfileError, match="not a readable .npz"):
        Profile.load(saved)


@pytest.mark.parametrize("change, named", [
    (lambda d: d["fingerprint"].update(vocab_size=10**9), "would take .* GiB"),
    (lambda d: d["fingerprint"].update(num_experts="8"), "num_experts='8'"),
    (lambda d: d["fingerprint"].update(moe_layers=[0, -1]), "moe_layers"),
    (lambda d: d["fingerprint"].update(top_k=9), "inconsistent"),
    (lambda d: d.update(fingerprint=[1, 2]), "no 'fingerprint' section"),
    (lambda d: d["arrays"].update(file="../p.npz"), "must name a file beside it"),
    (lambda d: d.update(arrays=["p.npz"]), "no 'arrays' section"),
])
def test_a_foreign_or_tampered_document_is_named(saved, change, named):
    _edit(saved, change)
    with pytest.raises(ProfileError, match=named) as info:
        Profile.load(saved)
    assert str(saved) in str(info.value)


def test_another_schema_is_named(saved):
    saved.write_text(json.dumps({"architectures": ["OlmoeForCausalLM"], "model_type": "olmoe"}))  # a model config
    with pytest.raises(ProfileError, match="schema_version"):
        Profile.load(saved)
    saved.write_bytes(os.urandom(512))
    with pytest.raises(ProfileError, match=str(saved)):
        Profile.load(saved)


def test_a_profile_of_another_target_is_refused_before_its_sidecar_is_read(saved):
    saved.with_suffix(".npz").unlink()
    with pytest.raises(ProfileError, match="another target"):
        Profile.load(saved, TargetModel(tiny_model("olmoe", seed=1)))
