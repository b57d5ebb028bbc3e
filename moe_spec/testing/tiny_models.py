"""Tiny random models of every supported architecture, built in code (nothing downloaded).

Used by the tests, by `moe-spec make-tiny` and for trying the CLI without a trained model.
Shapes are small but keep what matters: several layers, several experts, top-k > 1.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

_COMMON = dict(
    vocab_size=96,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
_MOE = dict(num_experts_per_tok=2)

TINY_CONFIGS: dict[str, dict] = {
    "mixtral": {**_COMMON, **_MOE, "intermediate_size": 32, "num_local_experts": 8},
    "qwen2_moe": {
        **_COMMON, **_MOE, "intermediate_size": 32, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16,
        "num_experts": 8,
    },
    "qwen3_moe": {**_COMMON, **_MOE, "intermediate_size": 32, "moe_intermediate_size": 16, "num_experts": 8, "head_dim": 8},
    "olmoe": {**_COMMON, **_MOE, "intermediate_size": 16, "num_experts": 8},
    "deepseek_v3": {
        **_COMMON, **_MOE, "intermediate_size": 32, "moe_intermediate_size": 16, "n_routed_experts": 8,
        "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 0, "kv_lora_rank": 16,
        "q_lora_rank": None, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8, "num_key_value_heads": 4,
    },
    "gpt_oss": {
        **_COMMON, **_MOE, "num_hidden_layers": 2, "intermediate_size": 16, "num_local_experts": 8, "head_dim": 8,
        "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    },
    "phimoe": {**_COMMON, **_MOE, "intermediate_size": 32, "num_local_experts": 8},
    "qwen3": {**_COMMON, "intermediate_size": 64, "head_dim": 8},
    "llama": {**_COMMON, "intermediate_size": 64},
}
MOE_ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss", "phimoe")
DENSE_ARCHITECTURES = ("qwen3", "llama")


def tiny_model(
    model_type: str, seed: int = 0, attn_implementation: str | None = None, dtype: torch.dtype = torch.float32, **overrides
) -> PreTrainedModel:
    """A randomly initialised tiny causal LM of `model_type`, in eval mode."""
    if model_type not in TINY_CONFIGS:
        raise ValueError(f"no tiny config for {model_type!r}; have {sorted(TINY_CONFIGS)}")
    config = AutoConfig.for_model(model_type, **{**TINY_CONFIGS[model_type], **overrides})
    if attn_implementation is None:
        attn_implementation = "eager" if model_type == "gpt_oss" else "sdpa"
    with torch.random.fork_rng():  # seeded without touching the caller's global RNG
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=dtype)
        # random init leaves routers near uniform; widen the weights so routing and logits are decisive
        with torch.no_grad():
            for name, param in model.named_parameters():
                if param.dim() >= 2:
                    param.normal_(0.0, 0.2 if "embed" in name or "lm_head" in name else 0.1)
    return model.eval()
