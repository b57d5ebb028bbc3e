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
    "glm4_moe": {
        **_COMMON, **_MOE, "intermediate_size": 32, "moe_intermediate_size": 16, "n_routed_experts": 8,
        "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "head_dim": 8,
        "attention_bias": True, "use_qk_norm": True, "num_hidden_layers": 3,
    },
    "gpt_oss": {
        **_COMMON, **_MOE, "num_hidden_layers": 2, "intermediate_size": 16, "num_local_experts": 8, "head_dim": 8,
        "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    },
    "phimoe": {**_COMMON, **_MOE, "intermediate_size": 32, "num_local_experts": 8},
    "qwen3": {**_COMMON, "intermediate_size": 64, "head_dim": 8},
    "llama": {**_COMMON, "intermediate_size": 64},
    "mistral": {**_COMMON, "intermediate_size": 64, "sliding_window": None},
}
MOE_ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "glm4_moe", "gpt_oss", "phimoe")
DENSE_ARCHITECTURES = ("qwen3", "llama")

# The config keys that give each architecture able to carry one a sliding window of `window` tokens,
# as published checkpoints set them: one window on every layer (Mistral, whose config defaults to
# 4096, Mixtral, PhiMoE, Qwen3-MoE), or on the layers `layer_types` marks sliding (Qwen2-MoE from
# `max_window_layers` on, GPT-OSS every other layer).
def sliding_window_overrides(model_type: str, window: int) -> dict:
    """Config overrides giving a tiny `model_type` a sliding window (see above)."""
    if model_type in ("mistral", "mixtral", "phimoe"):
        return {"sliding_window": window}
    if model_type == "qwen3_moe":
        return {"use_sliding_window": True, "sliding_window": window}
    if model_type == "qwen2_moe":  # layer 0 full, layer 1 sliding
        return {"use_sliding_window": True, "sliding_window": window, "max_window_layers": 1,
                "layer_types": ["full_attention", "sliding_attention"]}
    if model_type == "gpt_oss":
        return {"sliding_window": window}
    raise ValueError(f"{model_type!r} carries no sliding window")


WINDOWED_ARCHITECTURES = ("mistral", "mixtral", "phimoe", "qwen3_moe", "qwen2_moe", "gpt_oss")


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


# Features of published MoE configs that the plain tiny configs leave off, each as (architecture,
# overrides): DeepSeek-V3/R1 (and GLM-4.5) start with dense layers, route within groups of experts
# and project queries through a LoRA; Qwen2/3-MoE checkpoints may keep some layers dense
# (`mlp_only_layers`) or make only every n-th layer sparse (`decoder_sparse_step`). Dense layers
# inside the stack shift every MoE layer's index away from its decoder layer's.
REAL_FEATURE_VARIANTS: dict[str, tuple[str, dict]] = {
    "deepseek_v3-dense-first-grouped": ("deepseek_v3", dict(
        num_hidden_layers=4, first_k_dense_replace=2, n_group=4, topk_group=2, q_lora_rank=16,
        topk_method="noaux_tc")),
    "qwen3_moe-mlp-only": ("qwen3_moe", dict(num_hidden_layers=3, mlp_only_layers=[0])),
    "qwen2_moe-sparse-step": ("qwen2_moe", dict(num_hidden_layers=4, decoder_sparse_step=2)),
}


def tiny_variant(name: str, seed: int = 0, **overrides) -> PreTrainedModel:
    """A tiny model with one of `REAL_FEATURE_VARIANTS`' features on."""
    if name not in REAL_FEATURE_VARIANTS:
        raise ValueError(f"no variant {name!r}; have {sorted(REAL_FEATURE_VARIANTS)}")
    model_type, features = REAL_FEATURE_VARIANTS[name]
    return tiny_model(model_type, seed=seed, **{**features, **overrides})


MTP_ARCHITECTURES = ("deepseek_v3", "glm4_moe")  # transformers 5.23 builds MTP layers for these (and a few others)


def tiny_mtp_checkpoint(model_type: str, folder, mtp_layers: int = 1, seed: int = 0, **overrides) -> PreTrainedModel:
    """A tiny `model_type` checkpoint written to `folder` with `mtp_layers` random MTP layers in the
    published layout (`model.layers.{N + k}.*`), loaded back from it (float32, eval mode)."""
    from moe_spec.drafters.mtp_layers import main_model_skipping_mtp_layers, new_mtp_layers, save_mtp_layers

    model = tiny_model(model_type, seed=seed, num_nextn_predict_layers=mtp_layers, **overrides)
    model.save_pretrained(folder)
    mtp = new_mtp_layers(model, mtp_layers, seed=seed)
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(seed + 1)
        for name, param in mtp.named_parameters():
            if param.dim() >= 2 and "embed" not in name and "shared_head" not in name:
                param.normal_(0.0, 0.1)
    save_mtp_layers(mtp, model, folder)
    attention = "eager" if model_type == "gpt_oss" else "sdpa"
    with main_model_skipping_mtp_layers(type(model), model.config):
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation=attention).eval()
