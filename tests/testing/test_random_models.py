"""Random models of real shapes: the shapes are the published ones (built on the meta device, no memory)."""

import torch

from moe_spec.core.target import TargetModel
from moe_spec.testing.random_models import EMBEDDED_SHAPE, TINY_SHAPE, random_model


def test_olmoe_1b_7b_has_the_published_shapes():
    target = TargetModel(random_model("olmoe-1b-7b", device="meta"))
    assert (target.num_layers, target.num_experts, target.top_k) == (16, 64, 8)
    assert target.config.hidden_size == 2048 and target.config.intermediate_size == 1024
    assert target.dtype == torch.bfloat16
    params = sum(p.numel() for p in target.model.parameters())
    assert 6.8e9 < params < 7.0e9, params  # OLMoE-1B-7B: 6.9B parameters


def test_the_tiny_shape_is_a_small_model_of_the_same_architecture():
    model = random_model(TINY_SHAPE, dtype=torch.float32)
    assert model.config.model_type == "olmoe" and sum(p.numel() for p in model.parameters()) < 1e6


def test_qwen3_30b_a3b_has_the_published_shapes_and_keeps_them_in_fewer_layers():
    full = random_model("qwen3-30b-a3b", device="meta")
    assert 30.3e9 < sum(p.numel() for p in full.parameters()) < 30.7e9  # Qwen3-30B-A3B: 30.5B parameters
    target = TargetModel(random_model("qwen3-30b-a3b", device="meta", layers=8))
    assert (target.num_layers, target.num_experts, target.top_k) == (8, 128, 8)
    config = target.config
    assert (config.hidden_size, config.moe_intermediate_size, config.head_dim) == (2048, 768, 128)
    assert (config.num_attention_heads, config.num_key_value_heads) == (32, 4)
    layer = {name: p.shape for name, p in target.model.model.layers[7].named_parameters()}
    assert layer == {name: p.shape for name, p in full.model.layers[7].named_parameters()}


def test_make_random_refuses_more_layers_than_the_shape_has(tmp_path, capsys):
    from moe_spec.cli.main import main

    assert main(["make-random", "--shape", "tiny-olmoe", "--layers", "9", "--out", str(tmp_path / "m")]) != 0
    assert "--layers" in capsys.readouterr().err and not (tmp_path / "m").exists()
    assert main(["make-random", "--shape", "tiny-olmoe", "--layers", "1", "--out", str(tmp_path / "m")]) == 0
    assert '"layers": 1' in capsys.readouterr().out


def test_the_embedded_shape_is_the_embedded_targets_config_with_random_weights():
    from moe_spec.loading import DEFAULT_TARGET, load_target

    model = random_model(EMBEDDED_SHAPE, dtype=torch.float32)
    embedded = load_target(DEFAULT_TARGET)
    assert model.config.to_dict() | {"dtype": None} == embedded.config.to_dict() | {"dtype": None}
    shapes = {name: p.shape for name, p in model.named_parameters()}
    assert shapes == {name: p.shape for name, p in embedded.named_parameters()}
    weight = "model.layers.0.mlp.experts.gate_up_proj"
    assert not torch.equal(model.get_parameter(weight), embedded.get_parameter(weight))
