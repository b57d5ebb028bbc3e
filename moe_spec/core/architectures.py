"""Which Hugging Face causal LMs moe_spec verifies trees on, and where their routers live.

One small record per architecture instead of a dispatch ladder: the class name of the router
module (every transformers 5.23 router returns `(router_logits, topk_weights, topk_indices)`),
whether the model needs eager attention, and whether its forward takes the attention mask as a
dict keyed by layer type (`config.layer_types`), which is how it applies a sliding window to
some layers only. The others apply `config.sliding_window`, when set, to every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from moe_spec.errors import UnsupportedArchitectureError


@dataclass(frozen=True)
class ArchitectureSpec:
    model_type: str
    router_class: str | None  # None: dense model, nothing to route
    needs_eager_attention: bool = False
    # the forward accepts {"full_attention": mask, "sliding_attention": mask} and hands each layer
    # the mask of its `config.layer_types` entry; without it, one mask serves every layer
    mask_by_layer_type: bool = False

    @property
    def is_moe(self) -> bool:
        return self.router_class is not None


_SPECS = (
    ArchitectureSpec("mixtral", "MixtralTopKRouter"),
    ArchitectureSpec("qwen2_moe", "Qwen2MoeTopKRouter", mask_by_layer_type=True),
    ArchitectureSpec("qwen3_moe", "Qwen3MoeTopKRouter"),
    ArchitectureSpec("olmoe", "OlmoeTopKRouter"),
    ArchitectureSpec("deepseek_v3", "DeepseekV3TopkRouter"),
    ArchitectureSpec("glm4_moe", "Glm4MoeTopkRouter"),
    # GPT-OSS has no SDPA path (attention sinks) and alternates sliding / full layers.
    ArchitectureSpec("gpt_oss", "GptOssTopKRouter", needs_eager_attention=True, mask_by_layer_type=True),
    ArchitectureSpec("phimoe", "PhimoeTopKRouter"),
    # Dense targets are fine: they simply have no experts to price.
    ArchitectureSpec("llama", None),
    ArchitectureSpec("mistral", None),
    ArchitectureSpec("qwen2", None, mask_by_layer_type=True),
    ArchitectureSpec("qwen3", None, mask_by_layer_type=True),
)
SUPPORTED_ARCHITECTURES: dict[str, ArchitectureSpec] = {spec.model_type: spec for spec in _SPECS}


def architecture_of(model: nn.Module) -> ArchitectureSpec:
    """The spec of a transformers causal LM, or a clear error naming its architecture."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None) or type(model).__name__
    spec = SUPPORTED_ARCHITECTURES.get(model_type)
    if spec is None:
        supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
        raise UnsupportedArchitectureError(
            f"architecture {model_type!r} ({type(model).__name__}) is not supported by moe_spec; "
            f"supported model types: {supported}"
        )
    return spec
