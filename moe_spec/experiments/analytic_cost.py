"""A cost model from a model's shapes and a device's bandwidth and FLOP rate (no measurement).

The same formula as the measured one (`cost_model.py`),

    verify_ms(T, U) = base_ms + per_token_ms * T + per_expert_ms * sum_l U[l],

with each coefficient derived from bytes moved and FLOPs, for decoding at batch 1 where weights are
read once per forward:

- per_expert_ms = 3 * hidden * moe_intermediate * bytes_per_param / expert_bandwidth
  (gate, up and down projections of one expert; `expert_bandwidth` is where the experts are read
  from: device memory, or the host link when experts are offloaded);
- per_token_ms = 2 * active_params_per_token / flop_rate (one multiply-add per active weight:
  attention projections, dense MLPs, shared experts, routers, top-k experts, lm_head);
- base_ms = (always-read weight bytes + KV cache bytes for `context_tokens`) / memory_bandwidth
  + call_overhead_ms, always-read weights being attention projections, dense MLPs, shared experts,
  routers and the lm_head (the embedding table is gathered, not read whole).

Peak figures are used as given, with no efficiency factor: the result is what the hardware allows,
a lower bound on time. Attention is priced as standard multi-head / grouped-query attention from
`num_attention_heads`, `num_key_value_heads` and `head_dim` (an approximation for MLA models).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from moe_spec.profile.cost_model import CostModel


@dataclass(frozen=True)
class Device:
    name: str
    memory_gb_per_s: float  # device memory bandwidth: attention, dense weights, KV cache
    expert_gb_per_s: float  # bandwidth expert weights arrive at (== memory unless offloaded)
    tflop_per_s: float  # dense matmul rate at the weights' dtype
    bytes_per_param: float = 2.0  # bf16 weights
    call_overhead_ms: float = 0.0  # fixed per forward (launches, host work); 0: not modelled
    note: str = ""

    def __post_init__(self):
        if min(self.memory_gb_per_s, self.expert_gb_per_s, self.tflop_per_s, self.bytes_per_param) <= 0:
            raise ValueError(f"device {self.name}: bandwidths, FLOP rate and bytes per parameter must be > 0")
        if self.call_overhead_ms < 0:
            raise ValueError(f"device {self.name}: call_overhead_ms must be >= 0")


DEVICES = {
    "gpu-h100-batch1": Device("gpu-h100-batch1", 3350.0, 3350.0, 989.0,
                              note="H100 SXM: 3.35 TB/s HBM3, 989 TFLOP/s dense bf16; all weights on the GPU"),
    "pcie-offload": Device("pcie-offload", 3350.0, 25.0, 989.0,
                           note="H100 with experts in host memory, streamed over PCIe 4.0 x16 (~25 GB/s)"),
    "cpu-ddr5": Device("cpu-ddr5", 80.0, 80.0, 2.0,
                       note="a workstation CPU: ~80 GB/s dual-channel DDR5, ~2 TFLOP/s fp32 vector peak"),
}


@dataclass(frozen=True)
class ModelShapes:
    hidden: int
    moe_intermediate: int  # width of one routed expert
    num_layers: int  # decoder layers
    num_moe_layers: int
    num_experts: int  # routed experts per MoE layer
    top_k: int
    dense_intermediate: int  # MLP width of the layers without experts
    shared_intermediate: int  # total width of the shared experts of an MoE layer (0: none)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int

    @staticmethod
    def from_config(config, num_moe_layers: int) -> "ModelShapes":
        """Shapes from a transformers config; `num_moe_layers` from the profile (layers with a router)."""
        config = config.get_text_config(decoder=True)
        hidden = int(config.hidden_size)
        heads = int(config.num_attention_heads)
        moe_intermediate = int(getattr(config, "moe_intermediate_size", None) or config.intermediate_size)
        shared = int(getattr(config, "shared_expert_intermediate_size", 0) or 0)
        shared = shared or int(getattr(config, "n_shared_experts", 0) or 0) * moe_intermediate
        experts = (getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
                   or getattr(config, "n_routed_experts", None) or 0)
        return ModelShapes(
            hidden=hidden, moe_intermediate=moe_intermediate, num_layers=int(config.num_hidden_layers),
            num_moe_layers=num_moe_layers, num_experts=int(experts), top_k=int(getattr(config, "num_experts_per_tok", 0) or 0),
            dense_intermediate=int(config.intermediate_size), shared_intermediate=shared, num_heads=heads,
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(config, "head_dim", None) or hidden // heads), vocab=int(config.vocab_size),
        )


def analytic_terms(shapes: ModelShapes, device: Device, context_tokens: int) -> dict:
    """Bytes, FLOPs and the resulting coefficients, each with its unit."""
    s = shapes
    attention = s.hidden * s.head_dim * (2 * s.num_heads + 2 * s.num_kv_heads)  # q, o + k, v projections
    dense_layers = s.num_layers - s.num_moe_layers
    always_read = (
        s.num_layers * attention
        + dense_layers * 3 * s.hidden * s.dense_intermediate
        + s.num_moe_layers * (3 * s.hidden * s.shared_intermediate + s.hidden * s.num_experts)  # shared experts, router
        + s.hidden * s.vocab  # lm_head
    )  # parameters
    expert_params = 3 * s.hidden * s.moe_intermediate
    active_per_token = always_read + s.num_moe_layers * s.top_k * expert_params
    kv_bytes = 2 * s.num_layers * s.num_kv_heads * s.head_dim * context_tokens * device.bytes_per_param
    bytes_per_expert = expert_params * device.bytes_per_param
    base_bytes = always_read * device.bytes_per_param + kv_bytes
    return {
        "bytes_per_expert": bytes_per_expert,
        "always_read_bytes": always_read * device.bytes_per_param,
        "kv_cache_bytes": kv_bytes,
        "flops_per_token": 2 * active_per_token,
        "context_tokens": context_tokens,
        # GB/s = 1e6 bytes/ms; TFLOP/s = 1e9 FLOP/ms
        "per_expert_ms": bytes_per_expert / (device.expert_gb_per_s * 1e6),
        "per_token_ms": 2 * active_per_token / (device.tflop_per_s * 1e9),
        "base_ms": base_bytes / (device.memory_gb_per_s * 1e6) + device.call_overhead_ms,
        "device": asdict(device),
        "shapes": asdict(shapes),
    }


def analytic_cost_model(shapes: ModelShapes, device: Device, context_tokens: int = 512) -> CostModel:
    terms = analytic_terms(shapes, device, context_tokens)
    return CostModel(terms["base_ms"], terms["per_token_ms"], (terms["per_expert_ms"],), shapes.num_moe_layers,
                     source=f"analytic:{device.name}")


def scaled_expert_cost(cost: CostModel, scale: float) -> CostModel:
    """The same model with every per-expert cost multiplied by `scale` (expert loading made dearer);
    a fetch cost, measured on its tier, is kept as it is."""
    if scale <= 0:
        raise ValueError(f"per-expert scale must be > 0, got {scale}")
    source = cost.source if scale == 1 else f"{cost.source}, per-expert x{scale:g}"
    return CostModel(cost.base_ms, cost.per_token_ms, tuple(c * scale for c in cost.per_expert_ms), cost.num_layers, source,
                     cost.per_row_ms, cost.fetch)
