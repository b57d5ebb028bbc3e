"""EAGLE-3 head folders in every published layout: detected, read back equal, and every way one can be
wrong (or not fit its target) refused before anything runs, naming the file and the field."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_spec.core.target import TargetModel
from moe_spec.drafters.eagle import EagleDrafter
from moe_spec.drafters.eagle_head import EagleHead
from moe_spec.drafters.head_layouts import CONFIG_FILE, LAYOUTS, WEIGHTS_FILE, save_head
from moe_spec.errors import DraftHeadMismatchError, MoeSpecError
from moe_spec.testing.helpers import random_eagle_head
from moe_spec.testing.tiny_models import tiny_model


@pytest.fixture(scope="module")
def target():
    return TargetModel(tiny_model("qwen3_moe"))


@pytest.fixture(params=LAYOUTS)
def saved(request, target, tmp_path):
    head = random_eagle_head(target, draft_vocab=32)
    save_head(head, tmp_path, request.param, dtype=torch.float32)
    return tmp_path, head, request.param


def _edit_config(folder, edit):
    config = json.loads((folder / CONFIG_FILE).read_text())
    edit(config)
    (folder / CONFIG_FILE).write_text(json.dumps(config))


def _edit_weights(folder, edit):
    state = load_file(folder / WEIGHTS_FILE)
    edit(state)
    save_file(state, folder / WEIGHTS_FILE)


def test_every_layout_reads_back_equal_and_is_detected(saved):
    folder, head, layout = saved
    loaded = EagleHead.from_pretrained(folder)
    assert loaded.layout == layout and loaded.config == head.config
    assert torch.equal(loaded.draft_to_target, head.draft_to_target)
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_the_file_holds_the_published_names_and_vocabulary_maps(saved):
    folder, head, layout = saved
    state = load_file(folder / WEIGHTS_FILE)
    layer = "layers.0." if layout == "speculators" else "midlayer."
    assert {f"{layer}self_attn.q_proj.weight", f"{layer}hidden_norm.weight", "fc.weight", "norm.weight",
            "lm_head.weight", "d2t", "t2d"} <= set(state)
    assert state[f"{layer}self_attn.q_proj.weight"].shape[1] == 2 * head.config.hidden_size  # q/k/v see [embed, g]
    assert "embed_tokens.weight" not in state  # the target's embedding is used
    assert torch.equal(torch.arange(32) + state["d2t"], head.draft_to_target)
    assert state["t2d"].dtype == torch.bool and int(state["t2d"].sum()) == 32
    assert bool(state["t2d"][head.draft_to_target].all())


def test_equal_vocabularies_need_no_maps(target, tmp_path):
    head = random_eagle_head(target, draft_vocab=target.vocab_size)
    head.draft_to_target.copy_(torch.arange(target.vocab_size))
    save_head(head, tmp_path, "speculators")
    assert not {"d2t", "t2d"} & set(load_file(tmp_path / WEIGHTS_FILE))
    assert torch.equal(EagleHead.from_pretrained(tmp_path).draft_to_target, torch.arange(target.vocab_size))


def test_a_head_with_its_own_embedding_uses_it(target, tmp_path):
    head = random_eagle_head(target, draft_vocab=32)
    own = EagleHead(head.config, head.draft_to_target, with_embedding=True)
    own.load_state_dict({**head.state_dict(), "embed_tokens.weight": torch.randn(target.vocab_size, 32)})
    save_head(own, tmp_path, "specforge", dtype=torch.float32)
    loaded = EagleHead.from_pretrained(tmp_path)
    assert loaded.embed_tokens is not None
    assert loaded.embedding(target.model.get_input_embeddings()) is loaded.embed_tokens


def test_an_old_moe_spec_head_must_be_retrained(tmp_path):
    (tmp_path / CONFIG_FILE).write_text(json.dumps({"kind": "moe_spec.eagle_head", "target_vocab_size": 96}))
    with pytest.raises(MoeSpecError, match="retrain it with `moe-spec train-draft`"):
        EagleHead.from_pretrained(tmp_path)


@pytest.mark.parametrize("text, named", [
    ("[1, 2, 3]", "not a JSON object"),
    ('{"architectures": ["LlamaForCausalLMEagle3"], "vocab', "cannot read"),
    ('{"architectures": ["MixtralForCausalLM"]}', "not an EAGLE-3 head config"),
    ('{"speculators_model_type": "mlp"}', "speculators_model_type 'mlp'"),
])
def test_a_foreign_or_broken_config_is_named(saved, text, named):
    folder, _, _ = saved
    (folder / CONFIG_FILE).write_text(text)
    with pytest.raises(MoeSpecError, match=named) as info:
        EagleHead.from_pretrained(folder)
    assert str(folder / CONFIG_FILE) in str(info.value)


def _layer(config: dict) -> dict:
    """The part of a config.json that holds the layer's Llama fields."""
    return config.get("transformer_layer_config", config)


@pytest.mark.parametrize("edit, named", [
    (lambda c: c.update(draft_vocab_size="32"), "draft_vocab_size must be an integer"),
    (lambda c: _layer(c).update(hidden_size=-32), "hidden_size must be an integer >= 1"),
    (lambda c: _layer(c).update(num_attention_heads=0), "num_attention_heads"),
    (lambda c: _layer(c).update(num_key_value_heads=3), "num_key_value_heads 3 must divide"),
    (lambda c: _layer(c).pop("intermediate_size"), "intermediate_size is missing"),
    (lambda c: _layer(c).update(rms_norm_eps=True), "rms_norm_eps"),
    (lambda c: c.update(norm_before_residual="yes"), "norm_before_residual must be true or false"),
    (lambda c: c.update(draft_vocab_size=10**6), "draft_vocab_size 1000000 must be in"),
])
def test_config_fields_of_the_wrong_type_are_named(saved, edit, named):
    folder, _, _ = saved
    _edit_config(folder, edit)
    with pytest.raises(MoeSpecError, match=named) as info:
        EagleHead.from_pretrained(folder)
    assert str(folder / CONFIG_FILE) in str(info.value)


def test_a_config_claiming_a_huge_head_fails_on_the_header_before_allocating(saved):
    folder, _, _ = saved
    _edit_config(folder, lambda c: (_layer(c).update(hidden_size=1_000_000, vocab_size=1_000_000),
                                    c.update(vocab_size=1_000_000, draft_vocab_size=1_000_000)))
    with pytest.raises(MoeSpecError, match="holds other tensors than expected.*shape"):
        EagleHead.from_pretrained(folder)  # allocating this head would take terabytes


@pytest.mark.parametrize("edit, named", [
    (lambda s: s.pop("lm_head.weight"), "missing lm_head.weight"),
    (lambda s: s.update(extra=torch.zeros(3)), "unexpected extra"),
    (lambda s: s.update({"fc.weight": s["fc.weight"][:, :-1].contiguous()}), "fc.weight: shape"),
    (lambda s: s.update(d2t=s["d2t"].int()), "d2t: dtype I32"),
    (lambda s: s.update(d2t=s["d2t"] + 10_000), "d2t maps draft ids outside the target vocabulary"),
    (lambda s: s.update(d2t=-torch.arange(32)), "d2t maps two draft ids onto one target id"),
    (lambda s: s.update(t2d=~s["t2d"]), "t2d does not mark"),
    (lambda s: s.update({"norm.weight": s["norm.weight"].long()}), "not floating point"),
])
def test_weights_that_do_not_fit_the_config_are_named(saved, edit, named):
    folder, _, _ = saved
    _edit_weights(folder, edit)
    with pytest.raises(MoeSpecError, match=named) as info:
        EagleHead.from_pretrained(folder)
    assert str(folder / WEIGHTS_FILE) in str(info.value)


def test_a_missing_weights_file_is_named(saved):
    folder, _, _ = saved
    (folder / WEIGHTS_FILE).unlink()
    with pytest.raises(MoeSpecError, match="has no model.safetensors"):
        EagleHead.from_pretrained(folder)


def test_truncated_weights_are_named(saved):
    folder, _, _ = saved
    path = folder / WEIGHTS_FILE
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(MoeSpecError, match="truncated"):
        EagleHead.from_pretrained(folder)


@pytest.mark.parametrize("content", [b"", b"\x01\x02", os.urandom(4096), b"\x10\x00\x00\x00\x00\x00\x00\x00[1, 2, 3, 4, 5, 6]"])
def test_random_bytes_as_weights_are_named(saved, content):
    folder, _, _ = saved
    (folder / WEIGHTS_FILE).write_bytes(content)
    with pytest.raises(MoeSpecError, match=str(folder / WEIGHTS_FILE)):
        EagleHead.from_pretrained(folder)


def test_pickled_weights_are_refused_with_a_conversion_hint(target, tmp_path):
    """Some of the EAGLE authors' heads ship pytorch_model.bin, a pickle: moe_spec never unpickles, and says
    how to convert it once."""
    head = random_eagle_head(target, draft_vocab=32)
    save_head(head, tmp_path, "eagle", dtype=torch.float32)
    (tmp_path / WEIGHTS_FILE).rename(tmp_path / "pytorch_model.bin")
    with pytest.raises(MoeSpecError, match="is a pickle, which moe_spec never reads.*save_file"):
        EagleHead.from_pretrained(tmp_path)


@pytest.mark.parametrize("feature_layers, named", [((1, 2, 7), "aux layers"), ((1, 2), "fc.weight: shape")])
def test_feature_layers_that_the_target_lacks_are_refused(target, tmp_path, feature_layers, named):
    head = random_eagle_head(target, draft_vocab=32)
    head.config = head.config.with_changes(aux_layers=feature_layers)
    save_head(head, tmp_path, "speculators")
    with pytest.raises((DraftHeadMismatchError, MoeSpecError), match=named):
        EagleDrafter.from_pretrained(tmp_path, target)


def test_a_layout_that_cannot_hold_a_variant_says_so(target, tmp_path):
    head = random_eagle_head(target, draft_vocab=32)
    deep = EagleHead(head.config.with_changes(num_layers=2), head.draft_to_target)
    with pytest.raises(MoeSpecError, match="save it in the speculators layout"):
        save_head(deep, tmp_path, "eagle")


def test_a_sharded_head_loads_and_a_wrong_index_is_named(target, tmp_path):
    """Heads for large vocabularies ship in safetensors shards with an index."""
    head = random_eagle_head(target, draft_vocab=32)
    save_head(head, tmp_path, "speculators", dtype=torch.float32)
    state = load_file(tmp_path / WEIGHTS_FILE)
    (tmp_path / WEIGHTS_FILE).unlink()
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in halves.items():
        save_file({n: state[n] for n in part}, tmp_path / file)
    index = {"metadata": {}, "weight_map": {n: f for f, part in halves.items() for n in part}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert torch.equal(EagleHead.from_pretrained(tmp_path).fc.weight, head.fc.weight)
    index["weight_map"].pop("norm.weight")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(MoeSpecError, match="indexes other tensors than expected: missing \\['norm.weight'\\]"):
        EagleHead.from_pretrained(tmp_path)
    index["weight_map"]["norm.weight"] = "../elsewhere.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(MoeSpecError, match="must be a file name in the same folder"):
        EagleHead.from_pretrained(tmp_path)


def test_feature_layers_are_read_in_the_order_engines_fuse_them(saved):
    """vLLM, SGLang and EAGLE capture each target layer once, walking the layers in order: a file's ids
    are read ascending, and a layer named twice is refused."""
    folder, _, layout = saved
    specforge = layout == "specforge"

    def set_ids(config, ids):
        (config["eagle_config"] if specforge else config)["eagle_aux_hidden_state_layer_ids"] = ids

    _edit_config(folder, lambda c: set_ids(c, [2, 0, 1]))
    assert EagleHead.from_pretrained(folder).config.aux_layers == ((1, 2, 3) if specforge else (0, 1, 2))
    _edit_config(folder, lambda c: set_ids(c, [1, 1, 2]))
    with pytest.raises(MoeSpecError, match="names a layer twice"):
        EagleHead.from_pretrained(folder)
