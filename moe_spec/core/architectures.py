"""Which Hugging Face causal LMs moe_spec verifies trees on, and where their routers live.

One small record per architecture instead of a dispatch ladder: the class name of the router
module (every transformers 5.23 router returns `(router_logits, topk_weights, topk_indices)`),
whether the model needs eager attention, and whether it has sliding-window layers that need
the dict form of the attention mask.
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
    has_sliding_layers: bool = False

    @property
    def is_moe(self) -> bool:
        return self.router_class is not None


_SPECS = (
    ArchitectureSpec("mixtral", "MixtralTopKRouter"),
    ArchitectureSpec("qwen2_moe", "Qwen2MoeTopKRouter"),
    ArchitectureSpec("qwen3_moe", "Qwen3MoeTopKRouter"),
    ArchitectureSpec("olmoe", "OlmoeTopKRouter"),
    ArchitectureSpec("deepseek_v3", "DeepseekV3TopkRouter"),
    # GPT-OSS has no SDPA path (attention sinks) and alternates sliding / full layers.
    ArchitectureSpec("gpt_oss", "GptOssTopKRouter", needs_eager_attention=True, has_sliding_layers=True),
    ArchitectureSpec("phimoe", "PhimoeTopKRouter"),
    # Dense targets are fine: they simply have no experts to price.
    ArchitectureSpec("llama", None),
    ArchitectureSpec("mistral", None),
    ArchitectureSpec("qwen2", None),
    ArchitectureSpec("qwen3", None),
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
