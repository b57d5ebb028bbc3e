"""`EagleConfig`: what an EAGLE-3 draft head is, independent of the file layout it came in.

The head's decoder layers are described by a Llama-style config dict (`layer`, as speculators'
`transformer_layer_config` and the top level of EAGLE's and SpecForge's config.json); transformers
reads it (`LlamaConfig`, or `Qwen3Config` for heads with q/k norms), so rope scaling and the other
fields are interpreted exactly as transformers interprets them for a target. The rest is what the
EAGLE-3 architecture adds: the target layers it fuses, the draft vocabulary and the norm variants
that published heads use. Every file layout maps onto this (`moe_spec.drafters.head_layouts`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from transformers import LlamaConfig, PretrainedConfig, Qwen3Config


# the Llama config fields a head's layer may carry; anything else in `layer` is ignored by the
# head (a published config.json carries bos/eos ids, torch_dtype and other serving fields)
LAYER_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "hidden_act", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
                "max_position_embeddings", "attention_bias", "mlp_bias", "pretraining_tp")


@dataclass(frozen=True)
class EagleConfig:
    layer: dict  # Llama-style fields of the head's decoder layers (`LAYER_FIELDS`)
    vocab_size: int  # the target's vocabulary
    aux_layers: tuple[int, ...]  # indices into the target's `hidden_states`, ascending; (): EAGLE's default
    target_hidden_size: int = 0  # 0: the head's hidden size
    draft_vocab_size: int = 0  # 0: the target's vocabulary
    num_layers: int = 1
    qk_norm: bool = False  # qwen3-style RMS norms on each head's q and k
    norm_before_residual: bool = False  # the first layer's residual is hidden_norm(g) instead of g
    norm_before_fc: bool = False  # one RMS norm over the concatenated features before fc (gpt-oss heads)
    fc_norm: bool = False  # an RMS norm on each feature layer before the concatenation
    norm_output: bool = False  # drafted nodes feed back norm(x) rather than x (speculators' "Eagle 3.1")
    logits_norm: bool = True  # logits = lm_head(norm(x)); False: lm_head(x) (SpecForge's `norm_output: false`)
    verifier: str = ""  # the target the head was trained for, as its file names it (informational)

    def __post_init__(self):
        layer = {k: v for k, v in dict(self.layer).items() if k in LAYER_FIELDS}
        object.__setattr__(self, "layer", layer)
        object.__setattr__(self, "aux_layers", tuple(int(i) for i in self.aux_layers))
        for name in ("hidden_size", "num_attention_heads", "intermediate_size"):
            value = layer.get(name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {self.vocab_size}")
        if not 1 <= self.draft_vocab <= self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} must be in 1..{self.vocab_size} (vocab_size)")
        if self.aux_layers and min(self.aux_layers) < 0:
            raise ValueError(f"aux_layers must be hidden-state indices >= 0, got {list(self.aux_layers)}")
        if any(b <= a for a, b in zip(self.aux_layers, self.aux_layers[1:])):
            # every engine captures each layer once, in ascending order, and fuses them in that order
            raise ValueError(f"aux_layers must be distinct and ascending, got {list(self.aux_layers)}")
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("norm_before_fc and fc_norm exclude each other")
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if self.target_hidden_size < 0:
            raise ValueError(f"target_hidden_size must be >= 0, got {self.target_hidden_size}")
        heads, kv = layer["num_attention_heads"], layer.get("num_key_value_heads") or layer["num_attention_heads"]
        if not isinstance(kv, int) or kv < 1 or heads % kv:
            raise ValueError(f"num_key_value_heads {kv!r} must divide num_attention_heads {heads}")
        if "head_dim" not in layer and layer["hidden_size"] % heads:
            raise ValueError(f"hidden_size {layer['hidden_size']} is not divisible by num_attention_heads {heads}")
        object.__setattr__(self, "layer", _canonical(layer))

    # -- derived sizes ----------------------------------------------------------------------------

    @property
    def hidden_size(self) -> int:
        return self.layer["hidden_size"]

    @property
    def fused_size(self) -> int:
        """The target's hidden size, the width of each fused feature layer."""
        return self.target_hidden_size or self.hidden_size

    @property
    def draft_vocab(self) -> int:
        return self.draft_vocab_size or self.vocab_size

    @property
    def num_feature_layers(self) -> int:
        return len(self.aux_layers) or 3

    def feature_layers_for(self, num_layers: int) -> tuple[int, ...]:
        """The target `hidden_states` this head fuses, for an N-layer target: its own, else EAGLE's default."""
        return self.aux_layers or eagle_default_layers(num_layers)

    def with_changes(self, **changes) -> "EagleConfig":
        return replace(self, **changes)

    def layer_config(self) -> PretrainedConfig:
        """The transformers config of the head's decoder layers (never saved on its own)."""
        kind = Qwen3Config if self.qk_norm else LlamaConfig
        config = kind(**self.layer, num_hidden_layers=self.num_layers, vocab_size=self.draft_vocab)
        if self.qk_norm:
            config.layer_types = ["full_attention"] * self.num_layers
            config.sliding_window = None
        config._attn_implementation = "sdpa"  # takes the float additive tree mask as is
        return config


def eagle_default_layers(num_layers: int) -> tuple[int, int, int]:
    """The layers a published head that names none fuses: `hidden_states[2, N // 2, N - 3]`, the inputs
    of those layers, as EAGLE, SpecForge, speculators and vLLM all default."""
    return 2, num_layers // 2, num_layers - 3


def _canonical(layer: dict) -> dict:
    """One spelling of a layer's fields, as transformers 5 reads them: `head_dim` and `num_key_value_heads`
    explicit, rope as `rope_parameters` (a legacy `rope_theta` / `rope_scaling` converted by transformers)."""
    built = LlamaConfig(**layer)
    canonical = {k: v for k, v in layer.items() if k not in ("rope_theta", "rope_scaling", "rope_parameters")}
    canonical.update(head_dim=int(built.head_dim), num_key_value_heads=int(built.num_key_value_heads),
                     rope_parameters=dict(built.rope_parameters))
    return canonical


def layer_dict_for(hidden_size: int, num_attention_heads: int, intermediate_size: int, *, num_key_value_heads: int = 0,
                   rms_norm_eps: float = 1e-6, rope_theta: float = 10000.0, max_position_embeddings: int = 4096,
                   hidden_act: str = "silu") -> dict:
    """The `layer` dict of a new head (Llama fields, with `rope_theta` as published configs write it)."""
    return {"hidden_size": hidden_size, "intermediate_size": intermediate_size,
            "num_attention_heads": num_attention_heads,
            "num_key_value_heads": num_key_value_heads or num_attention_heads, "hidden_act": hidden_act,
            "rms_norm_eps": rms_norm_eps, "rope_theta": rope_theta,
            "max_position_embeddings": max_position_embeddings, "attention_bias": False, "mlp_bias": False}


def config_for_target(target, draft_vocab_size: int = 2048, intermediate_size: int = 0, num_attention_heads: int = 0,
                      **fields) -> EagleConfig:
    """A new head's `EagleConfig` for a `TargetModel`: the target's hidden size and (where it divides
    it) head count, its vocabulary, the layers it captures as features, the draft vocabulary capped
    at the target's; `intermediate_size` 0: 4 x hidden."""
    text = target.config
    hidden = int(text.hidden_size)
    heads = num_attention_heads or int(getattr(text, "num_attention_heads", 4) or 4)
    if hidden % heads:
        heads = 1
    layer = layer_dict_for(hidden, heads, intermediate_size or 4 * hidden,
                           max_position_embeddings=int(getattr(text, "max_position_embeddings", 0) or 4096))
    return EagleConfig(layer=layer, vocab_size=int(target.vocab_size),
                       aux_layers=fields.pop("aux_layers", target.feature_layers),
                       draft_vocab_size=min(draft_vocab_size, int(target.vocab_size)),
                       verifier=fields.pop("verifier", str(getattr(text, "_name_or_path", "") or "")), **fields)
