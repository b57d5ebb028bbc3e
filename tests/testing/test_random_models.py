"""Random models of real shapes: the shapes are the published ones (built on the meta device, no memory)."""

import torch

from moe_spec.core.target import TargetModel
from moe_spec.testing.random_models import TINY_SHAPE, random_model


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
