"""A draft head folder from elsewhere: every way it can be wrong is a MoeSpecError naming the file."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_spec.core.target import TargetModel
from moe_spec.drafters.eagle_head import CONFIG_FILE, WEIGHTS_FILE, EagleHead
from moe_spec.errors import MoeSpecError
from moe_spec.testing.helpers import random_eagle_head
from moe_spec.testing.tiny_models import tiny_model


@pytest.fixture
def saved(tmp_path):
    head = random_eagle_head(TargetModel(tiny_model("qwen3_moe")), draft_vocab=32)
    head.save_pretrained(tmp_path)
    return tmp_path, head


def _edit_config(folder, **changes):
    config = json.loads((folder / CONFIG_FILE).read_text())
    config.update(changes)
    (folder / CONFIG_FILE).write_text(json.dumps(config))


def _edit_weights(folder, edit):
    state = load_file(folder / WEIGHTS_FILE)
    edit(state)
    save_file(state, folder / WEIGHTS_FILE)


def test_a_saved_head_loads_back_equal(saved):
    folder, head = saved
    loaded = EagleHead.from_pretrained(folder)
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor.to(torch.bfloat16).to(loaded.state_dict()[name].dtype))


@pytest.mark.parametrize("text, named", [
    ("[1, 2, 3]", "not a JSON object"),
    ('{"kind": "moe_spec.eagle_head", "target_vocab', "cannot read"),
    ('{"kind": "something_else"}', "kind"),
])
def test_a_foreign_or_broken_config_is_named(saved, text, named):
    folder, _ = saved
    (folder / CONFIG_FILE).write_text(text)
    with pytest.raises(MoeSpecError, match=named) as info:
        EagleHead.from_pretrained(folder)
    assert str(folder / CONFIG_FILE) in str(info.value)


@pytest.mark.parametrize("changes, named", [
    (dict(draft_vocab_size="32"), "draft_vocab_size must be an integer"),
    (dict(target_hidden_size=-32), "target_hidden_size must be an integer >= 1"),
    (dict(num_attention_heads=0), "num_attention_heads"),
    (dict(feature_layers=[0, "x"]), "feature_layers"),
    (dict(rms_norm_eps=True), "rms_norm_eps"),
    (dict(surprise=1), "unknown"),
])
def test_config_fields_of_the_wrong_type_are_named(saved, changes, named):
    folder, _ = saved
    _edit_config(folder, **changes)
    with pytest.raises(MoeSpecError, match=named):
        EagleHead.from_pretrained(folder)


def test_a_config_claiming_a_huge_head_fails_on_the_header_before_allocating(saved):
    folder, _ = saved
    _edit_config(folder, target_hidden_size=1_000_000, target_vocab_size=1_000_000, draft_vocab_size=1_000_000)
    with pytest.raises(MoeSpecError, match="holds other tensors than expected.*shape"):
        EagleHead.from_pretrained(folder)  # allocating this head would take terabytes


@pytest.mark.parametrize("edit, named", [
    (lambda s: s.pop("lm_head.weight"), "missing lm_head.weight"),
    (lambda s: s.update(extra=torch.zeros(3)), "unexpected extra"),
    (lambda s: s.update({"fc.weight": s["fc.weight"][:, :-1].contiguous()}), "fc.weight: shape"),
    (lambda s: s.update(draft_to_target=s["draft_to_target"].int()), "draft_to_target: dtype I32"),
    (lambda s: s.update(draft_to_target=s["draft_to_target"] + 10_000), "outside the target vocabulary"),
    (lambda s: s.update({"norm.weight": s["norm.weight"].long()}), "not floating point"),
])
def test_weights_that_do_not_fit_the_config_are_named(saved, edit, named):
    folder, _ = saved
    _edit_weights(folder, edit)
    with pytest.raises(MoeSpecError, match=named) as info:
        EagleHead.from_pretrained(folder)
    assert str(folder / WEIGHTS_FILE) in str(info.value)


def test_truncated_weights_are_named(saved):
    folder, _ = saved
    path = folder / WEIGHTS_FILE
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(MoeSpecError, match="truncated"):
        EagleHead.from_pretrained(folder)


@pytest.mark.parametrize("content", [b"", b"\x01\x02", os.urandom(4096), b"\x10\x00\x00\x00\x00\x00\x00\x00[1, 2, 3, 4, 5, 6]"])
def test_random_bytes_as_weights_are_named(saved, content):
    folder, _ = saved
    (folder / WEIGHTS_FILE).write_bytes(content)
    with pytest.raises(MoeSpecError, match=str(folder / WEIGHTS_FILE)):
        EagleHead.from_pretrained(folder)
