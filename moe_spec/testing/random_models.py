"""Randomly initialised MoE targets with a real model's shapes, built in code (nothing downloaded).

A cost model depends on the shapes (bytes per expert, FLOPs per token, layers), not on what the
weights learnt, and the profiler times its latency grid under forced routing, so a random model
of a real model's shapes measures that model's verify cost on a device without its checkpoint.
Weights keep transformers' own initialisation (`initializer_range`): at these widths the wider
init that `tiny_models` uses for decisive routing would only blow up the activations.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from moe_spec.testing.tiny_models import TINY_CONFIGS, tiny_model

# shape name -> (model_type, config keys); values as in the published config.json
REAL_SHAPES: dict[str, tuple[str, dict]] = {
    # allenai/OLMoE-1B-7B-0924: 6.9B parameters, 1.3B active per token
    "olmoe-1b-7b": ("olmoe", dict(
        vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=16, num_experts=64, num_experts_per_tok=8, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rms_norm_eps=1e-5, norm_topk_prob=False,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=50279, pad_token_id=1,
    )),
    # Qwen/Qwen3-30B-A3B: 30.5B parameters, 3.3B active per token (61 GB in bf16: `layers` keeps fewer)
    "qwen3-30b-a3b": ("qwen3_moe", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645,
    )),
}
TINY_SHAPE = "tiny-olmoe"  # the same architecture at test size (`moe-spec make-tiny --arch olmoe`'s model)
# the embedded target's own config with random weights: its verify cost on a device where its weights
# cannot travel (the cost does not depend on what the weights learnt, see above)
EMBEDDED_SHAPE = "embedded"
SHAPES = (*REAL_SHAPES, EMBEDDED_SHAPE, TINY_SHAPE)


def shape_config(shape: str, layers: int | None = None) -> PretrainedConfig:
    """The transformers config of a named shape; `layers`: keep only the first that many decoder
    layers (each layer's shapes, and so its per-token and per-expert cost, stay the real model's)."""
    if shape == TINY_SHAPE:
        config = AutoConfig.for_model("olmoe", **TINY_CONFIGS["olmoe"])
    elif shape == EMBEDDED_SHAPE:
        from moe_spec.loading import DEFAULT_TARGET

        config = AutoConfig.from_pretrained(DEFAULT_TARGET)
    elif shape in REAL_SHAPES:
        model_type, keys = REAL_SHAPES[shape]
        config = AutoConfig.for_model(model_type, **keys)
    else:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    if layers is not None:
        if not 1 <= layers <= config.num_hidden_layers:
            raise ValueError(f"layers must be in [1, {config.num_hidden_layers}] for {shape}, got {layers}")
        config.num_hidden_layers = layers
        if isinstance(getattr(config, "layer_types", None), list):  # one entry per layer: keep the first ones
            config.layer_types = config.layer_types[:layers]
    return config


def random_model(shape: str, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                 seed: int = 0, layers: int | None = None) -> PreTrainedModel:
    """A randomly initialised causal LM of `shape` (its first `layers` decoder layers; None: all),
    created directly on `device` ("meta": shapes only), in eval mode."""
    if shape == TINY_SHAPE and layers is None:
        return tiny_model("olmoe", seed=seed, dtype=dtype).to(device)
    config = shape_config(shape, layers)
    with torch.random.fork_rng(), torch.device(device):  # seeded without touching the caller's RNG
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    return model.eval()
