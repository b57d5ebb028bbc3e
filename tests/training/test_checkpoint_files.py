"""train-target's checkpoint is data (safetensors + JSON), and a broken or foreign one is named."""

import json
import os
import pickle

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from moe_spec.errors import MoeSpecError
from moe_spec.training import train_target as tt

SETTINGS = tt.TrainSettings(out="unused", shape=tt.TINY_SHAPE, max_steps=4, seq_len=32)


def _fresh():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tt.build_config(SETTINGS.shape, 0),
                                                 experts_implementation=tt.EXPERTS_IMPLEMENTATION)
    return model, tt.make_optimizer(model, SETTINGS)


@pytest.fixture
def checkpoint(tmp_path):
    model, optimizer = _fresh()
    ids = torch.randint(0, SETTINGS.shape.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    tt._save_checkpoint(tmp_path, model, optimizer, tt.Progress(step=1, tokens_seen=32), SETTINGS)
    return tmp_path, model, optimizer


def _state(folder) -> dict:
    return json.loads((folder / tt.STATE_FILE).read_text())


def test_a_checkpoint_restores_model_optimizer_and_rng(checkpoint):
    folder, model, optimizer = checkpoint
    saved_rng = torch.tensor(_state(folder)["torch_rng"], dtype=torch.uint8)
    other, other_optimizer = _fresh()
    with torch.random.fork_rng():
        progress = tt._load_checkpoint(folder, other, other_optimizer, SETTINGS)
        assert torch.equal(torch.get_rng_state(), saved_rng)
    assert progress == tt.Progress(step=1, tokens_seen=32)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))
    mine, theirs = optimizer.state_dict(), other_optimizer.state_dict()
    assert mine["param_groups"] == theirs["param_groups"]
    assert all(torch.equal(mine["state"][i][k], theirs["state"][i][k]) for i in mine["state"] for k in mine["state"][i])
    assert sorted(p.name for p in folder.iterdir()) == ["state.json", "weights-1.safetensors"]


def test_a_newer_checkpoint_replaces_the_older_weights_file(checkpoint):
    folder, model, optimizer = checkpoint
    tt._save_checkpoint(folder, model, optimizer, tt.Progress(step=2), SETTINGS)
    assert sorted(p.name for p in folder.iterdir()) == ["state.json", "weights-2.safetensors"]


def _load(folder):
    return tt._load_checkpoint(folder, *_fresh(), SETTINGS)


@pytest.mark.parametrize("text, named", [
    ("[1, 2]", "not a moe_spec.train_target_checkpoint"),
    ('{"format": "moe_spec.train_target_checkpoint.v1", "progr', "cannot read checkpoint"),
    ('{"format": "something.else"}', "not a moe_spec.train_target_checkpoint"),
])
def test_a_foreign_or_broken_state_file_is_named(checkpoint, text, named):
    folder = checkpoint[0]
    (folder / tt.STATE_FILE).write_text(text)
    with pytest.raises(tt.CheckpointError, match=named) as info:
        _load(folder)
    assert str(folder / tt.STATE_FILE) in str(info.value)


@pytest.mark.parametrize("change, named", [
    (lambda s: s.update(progress={"step": 1, "surprise": 2}), "malformed"),
    (lambda s: s.update(torch_rng=[300] * 4), "malformed|torch_rng"),
    (lambda s: s.update(torch_rng=[1, 2, 3]), "torch_rng holds 3 bytes"),
    (lambda s: s["resume_key"].update(seed=7), "other settings"),
    (lambda s: s.pop("weights_sha256"), "malformed"),
])
def test_a_tampered_state_file_is_named(checkpoint, change, named):
    folder = checkpoint[0]
    state = _state(folder)
    change(state)
    (folder / tt.STATE_FILE).write_text(json.dumps(state))
    with pytest.raises(tt.CheckpointError, match=named):
        _load(folder)


@pytest.mark.parametrize("edit, named", [
    (lambda s: s.pop("optimizer.0.exp_avg"), "missing optimizer.0.exp_avg"),
    (lambda s: s.update({"model.lm_head.weight": s["model.lm_head.weight"][:-1].contiguous()}), "lm_head.weight: shape"),
    (lambda s: s.update({"optimizer.0.step": s["optimizer.0.step"].double()}), "dtype F64"),
    (lambda s: s.update(extra=torch.zeros(2)), "unexpected extra"),
])
def test_weights_that_do_not_fit_the_model_are_named(checkpoint, edit, named):
    folder = checkpoint[0]
    path = folder / _state(folder)["weights"]
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)
    with pytest.raises(MoeSpecError, match=named) as info:
        _load(folder)
    assert str(path) in str(info.value)


def test_corrupt_and_truncated_weights_are_named(checkpoint):
    folder = checkpoint[0]
    path = folder / _state(folder)["weights"]
    blob = bytearray(path.read_bytes())
    blob[-10] ^= 0xFF  # same size and header, other bytes
    path.write_bytes(bytes(blob))
    with pytest.raises(tt.CheckpointError, match="checksum"):
        _load(folder)
    path.write_bytes(bytes(blob[:-64]))
    with pytest.raises(MoeSpecError, match="truncated"):
        _load(folder)
    path.write_bytes(os.urandom(2048))
    with pytest.raises(MoeSpecError, match=str(path)):
        _load(folder)


def test_a_pickled_checkpoint_of_an_older_version_is_refused_not_loaded(tmp_path):
    class Bomb:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'ran'}",))

    (tmp_path / tt.LEGACY_CHECKPOINT).write_bytes(pickle.dumps(Bomb()))
    with pytest.raises(tt.CheckpointError, match="pickled checkpoint"):
        tt.has_checkpoint(tmp_path)
    assert not (tmp_path / "ran").exists()
    assert not tt.has_checkpoint(tmp_path / "elsewhere")
