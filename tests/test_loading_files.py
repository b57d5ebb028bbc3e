"""A model folder from elsewhere: load_target names what is wrong instead of decoding with random
or unpickled weights."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_spec.errors import MoeSpecError
from moe_spec.loading import load_target
from moe_spec.testing.tiny_models import tiny_model


@pytest.fixture
def folder(tmp_path):
    tiny_model("olmoe").save_pretrained(tmp_path)
    return tmp_path


def _edit_weights(folder, edit):
    state = load_file(folder / "model.safetensors")
    edit(state)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})


def test_a_saved_tiny_model_loads_as_saved(folder):
    loaded = load_target(folder)
    reference = tiny_model("olmoe")
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), reference.state_dict().values()))


@pytest.mark.parametrize("edit, named", [
    (lambda s: s.pop("model.norm.weight"), "missing keys: model.norm.weight"),
    (lambda s: s.update(surprise=torch.zeros(2)), "unexpected keys: surprise"),
    (lambda s: s.update({"model.norm.weight": torch.ones(7)}), "model.norm.weight"),
])
def test_weights_that_do_not_fit_the_config_are_named(folder, edit, named):
    _edit_weights(folder, edit)
    with pytest.raises(MoeSpecError, match=named) as info:
        load_target(folder)
    assert str(folder) in str(info.value)


def test_truncated_and_random_weights_are_named_before_loading(folder):
    path = folder / "model.safetensors"
    blob = path.read_bytes()
    path.write_bytes(blob[:-100])
    with pytest.raises(MoeSpecError, match=f"{path}.*truncated"):
        load_target(folder)
    path.write_bytes(os.urandom(4096))
    with pytest.raises(MoeSpecError, match=str(path)):
        load_target(folder)


def test_pickled_weights_are_not_loaded(folder):
    (folder / "model.safetensors").rename(folder / "moved")
    torch.save(tiny_model("olmoe").state_dict(), folder / "pytorch_model.bin")  # what transformers would unpickle
    with pytest.raises(MoeSpecError, match="model.safetensors"):
        load_target(folder)


@pytest.mark.parametrize("config", ["[1, 2]", json.dumps({"model_type": "no_such_architecture"}), "{not json"])
def test_a_foreign_config_is_named(folder, config):
    (folder / "config.json").write_text(config)
    with pytest.raises(MoeSpecError, match="config"):
        load_target(folder)
