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
    # Qwen/Qwen3-30B-A3B's layer shape (128 experts of width 768, top-8, GQA 32/4 heads of 128) in 8 of
    # its 48 layers: every per-layer and per-expert cost is the real model's, and it saves in ~11 GB
    "qwen3-30b-a3b-8l": ("qwen3_moe", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=8,
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


def shape_config(shape: str) -> PretrainedConfig:
    """The transformers config of a named shape."""
    if shape == TINY_SHAPE:
        return AutoConfig.for_model("olmoe", **TINY_CONFIGS["olmoe"])
    if shape == EMBEDDED_SHAPE:
        from moe_spec.loading import DEFAULT_TARGET

        return AutoConfig.from_pretrained(DEFAULT_TARGET)
    if shape not in REAL_SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    model_type, keys = REAL_SHAPES[shape]
    return AutoConfig.for_model(model_type, **keys)


def random_model(shape: str, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                 seed: int = 0) -> PreTrainedModel:
    """A randomly initialised causal LM of `shape`, created directly on `device` ("meta": shapes only), in eval mode."""
    if shape == TINY_SHAPE:
        return tiny_model("olmoe", seed=seed, dtype=dtype).to(device)
    config = shape_config(shape)
    with torch.random.fork_rng(), torch.device(device):  # seeded without touching the caller's RNG
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    return model.eval()
