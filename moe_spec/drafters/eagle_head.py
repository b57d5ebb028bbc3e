"""The EAGLE-style draft head: one decoder layer over (target features, next token) pairs.

EAGLE (Li et al., 2024) drafts with a single transformer layer that reads the target's own hidden
states; EAGLE-3 fuses low, middle and last layer states and trains with a "training-time test"
(the head fed its own outputs); both keep the target's embedding. Here:

    pair t = (features of position t, token t+1)  ->  hidden h_t  ->  distribution of token t+2

    g_t = fc(features_t.flatten())          # [S*D] -> [D], the target's S feature layers fused
    x_t = proj([norm_g(g_t), norm_e(embed(token_{t+1}))])   # [2D] -> [D]
    h_t = decoder_layer(x_t)                 # a LlamaDecoderLayer with its own KV cache
    logits_t = lm_head(norm(h_t))            # onto the reduced draft vocabulary

Feature-feeding convention (as EAGLE): where the target's features of a position are unknown
(drafted tokens), `h` of the pair before it -- the decoder layer's output, before the final norm --
stands in for `g`. `norm_g` puts both on one scale, and training unrolls the head on its own `h`
the same way (see `moe_spec.training.train_draft`).

The token embedding is the target's input embedding module, passed in at call time and never
trained or saved with the head. The output projection covers `draft_vocab_size` frequent target
tokens; the `draft_to_target` buffer maps a draft id to the target's token id.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from transformers import DynamicCache, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from moe_spec.errors import DraftHeadMismatchError, MoeSpecError
from moe_spec.tensor_file import TensorFileError, read_tensors

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
HEAD_KIND = "moe_spec.eagle_head"


@dataclass(frozen=True)
class EagleConfig:
    # target fingerprint: a head only fits the target it was trained on
    target_model_type: str
    target_vocab_size: int
    target_hidden_size: int
    target_num_layers: int
    feature_layers: tuple[int, ...]  # indices into the target's hidden_states, S of them
    # the head
    draft_vocab_size: int = 2048
    num_attention_heads: int = 4
    intermediate_size: int = 0  # 0: 4 * hidden size
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096

    def __post_init__(self):
        object.__setattr__(self, "feature_layers", tuple(int(i) for i in self.feature_layers))
        if not self.feature_layers:
            raise ValueError("a draft head needs at least one feature layer")
        if not 0 < self.draft_vocab_size <= self.target_vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} must be in 1..{self.target_vocab_size}")
        if self.target_hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden size {self.target_hidden_size} is not divisible by {self.num_attention_heads} heads")
        if self.intermediate_size < 0:
            raise ValueError("intermediate_size must be >= 0")

    @property
    def hidden_size(self) -> int:
        return self.target_hidden_size

    @property
    def num_feature_layers(self) -> int:
        return len(self.feature_layers)

    @property
    def fingerprint(self) -> dict:
        return {
            "model_type": self.target_model_type,
            "vocab_size": self.target_vocab_size,
            "hidden_size": self.target_hidden_size,
            "num_hidden_layers": self.target_num_layers,
            "feature_layers": list(self.feature_layers),
        }

    def llama_config(self) -> LlamaConfig:
        """The config of the head's one decoder layer (built in code, never saved on its own)."""
        config = LlamaConfig(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size or 4 * self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_attention_heads,
            num_hidden_layers=1,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            vocab_size=self.draft_vocab_size,
        )
        config._attn_implementation = "sdpa"  # takes the float additive tree mask as is
        return config

    def to_json(self) -> str:
        return json.dumps({"kind": HEAD_KIND, **asdict(self)}, indent=2) + "\n"

    @staticmethod
    def from_json(text: str) -> "EagleConfig":
        raw = json.loads(text)
        if raw.pop("kind", None) != HEAD_KIND:
            raise MoeSpecError(f"not a moe_spec EAGLE head config (expected kind {HEAD_KIND!r})")
        known = {f.name for f in fields(EagleConfig)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise MoeSpecError(f"unknown EAGLE head config fields: {unknown}")
        return EagleConfig(**raw)


def fingerprint_of(target) -> dict:
    """The fingerprint of a `TargetModel`, in `EagleConfig.fingerprint`'s form."""
    return {
        "model_type": target.spec.model_type,
        "vocab_size": int(target.vocab_size),
        "hidden_size": int(target.config.hidden_size),
        "num_hidden_layers": int(target.num_layers),
        "feature_layers": [int(i) for i in target.feature_layers],
    }


def check_fits(config: EagleConfig, target) -> None:
    """Raise `DraftHeadMismatchError` naming every fingerprint field where head and target differ."""
    expected, actual = config.fingerprint, fingerprint_of(target)
    diffs = [f"{key}: head trained for {expected[key]}, target has {actual[key]}"
             for key in expected if expected[key] != actual[key]]
    if diffs:
        raise DraftHeadMismatchError("draft head does not fit this target; " + "; ".join(diffs))


def config_for_target(target, draft_vocab_size: int = 2048, **head) -> EagleConfig:
    """An `EagleConfig` fitted to a `TargetModel` (draft vocabulary capped at the target's)."""
    text = target.config
    hidden = int(text.hidden_size)
    heads = int(getattr(text, "num_attention_heads", 4) or 4)
    if hidden % heads:
        heads = 1
    return EagleConfig(
        target_model_type=target.spec.model_type,
        target_vocab_size=int(target.vocab_size),
        target_hidden_size=hidden,
        target_num_layers=int(target.num_layers),
        feature_layers=tuple(target.feature_layers),
        draft_vocab_size=min(draft_vocab_size, int(target.vocab_size)),
        **{"num_attention_heads": heads, **head},
    )


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., Q, K] bool -> [..., 1, Q, K] float: 0 where visible, dtype-min elsewhere (bool is wrong under eager)."""
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    mask.masked_fill_(~visible, torch.finfo(dtype).min)
    return mask.unsqueeze(-3)


class EagleHead(nn.Module):
    def __init__(self, config: EagleConfig, draft_to_target: torch.Tensor | None = None):
        super().__init__()
        self.config = config
        d, s = config.hidden_size, config.num_feature_layers
        llama = config.llama_config()
        self.fc = nn.Linear(s * d, d, bias=False)
        self.feature_norm = LlamaRMSNorm(d, eps=config.rms_norm_eps)
        self.embed_norm = LlamaRMSNorm(d, eps=config.rms_norm_eps)
        self.proj = nn.Linear(2 * d, d, bias=False)
        self.layer = LlamaDecoderLayer(llama, layer_idx=0)
        self.rotary = LlamaRotaryEmbedding(llama)
        self.norm = LlamaRMSNorm(d, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(d, config.draft_vocab_size, bias=False)
        if draft_to_target is None:
            draft_to_target = torch.arange(config.draft_vocab_size)
        if draft_to_target.shape != (config.draft_vocab_size,):
            raise ValueError(f"draft_to_target must have shape [{config.draft_vocab_size}]")
        self.register_buffer("draft_to_target", draft_to_target.long().clone())

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """[..., S, D] target features -> [..., D] (the `g` that the head's own `h` may replace)."""
        return self.fc(features.flatten(-2).to(self.fc.weight.dtype))

    def forward(
        self,
        g: torch.Tensor,  # [B, N, D]: fused target features, or the head's own h of the pair before
        token_embeds: torch.Tensor,  # [B, N, D]: target embeddings of the pairs' tokens
        attention_mask: torch.Tensor,  # [B, 1, N, P + N] float additive
        position_ids: torch.Tensor,  # [B, N] long
        cache: DynamicCache,  # P positions before the call, P + N after
    ) -> torch.Tensor:
        """[B, N, D] h: the decoder layer's output (pre-norm), fed back as `g` for deeper drafts."""
        dtype = self.proj.weight.dtype
        x = self.proj(torch.cat([self.feature_norm(g.to(dtype)), self.embed_norm(token_embeds.to(dtype))], dim=-1))
        rotary = self.rotary(x, position_ids)
        return self.layer(
            x, attention_mask=attention_mask.to(dtype), position_ids=position_ids, past_key_values=cache,
            use_cache=True, position_embeddings=rotary,
        )

    def unroll(self, features: torch.Tensor, token_embeds: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """The training-time test (EAGLE-3): `steps` passes over a sequence, pass k feeding on pass k-1.

        features: [B, T, S, D] target features; token_embeds: [B, T, D] of the same T tokens.
        Returns `steps` tensors [B, T-1, D]: h of pair t = (position t, token t+1) at pass k.
        Pass 0 reads the target's features; pass k > 0 reads h of pass k-1 at t-1 in their place,
        which is what a node at depth k+1 of a draft tree reads. Its attention sees what that node
        sees at inference: pass-0 keys up to t-k (committed pairs and the root pair) and one key of
        each pass j = 1..k at t-k+j (its drafted ancestors and itself). Outputs at t < k have no
        such context and carry no meaning.
        """
        batch, n = features.shape[0], features.shape[1] - 1
        g = self.fuse(features[:, :-1])  # [B, n, D]
        embeds = token_embeds[:, 1:]  # [B, n, D]
        t = torch.arange(n, device=features.device)
        positions = t[None].expand(batch, n)
        cache = DynamicCache()
        outputs = []
        for k in range(steps):
            blocks = [t[None, :] <= t[:, None] - k] + [t[None, :] == t[:, None] - k + j for j in range(1, k + 1)]
            mask = additive_mask(torch.cat(blocks, dim=-1)[None], self.proj.weight.dtype)  # [1, 1, n, (k+1) n]
            h = self(g, embeds, mask, positions, cache)  # [B, n, D]
            outputs.append(h)
            g = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], dim=1)  # position t reads h at t-1
        return outputs

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """[..., D] -> [..., V_draft] logits over the draft vocabulary."""
        return self.lm_head(self.norm(h))

    def save_pretrained(self, directory: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
        """config.json + model.safetensors (floating weights in `dtype`; the id map stays int64)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {name: (t.to(dtype) if t.is_floating_point() else t).detach().cpu().contiguous()
                 for name, t in self.state_dict().items()}
        save_file(state, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
        (directory / CONFIG_FILE).write_text(self.config.to_json())

    @staticmethod
    def from_pretrained(directory: str | Path, dtype: torch.dtype = torch.float32) -> "EagleHead":
        """The head saved by `save_pretrained`. The config is checked field by field and the weights
        file's header against the shapes that config implies (computed on the meta device) before
        any weight is allocated; anything else is a `MoeSpecError` naming the file."""
        directory = Path(directory)
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            if not (directory / name).is_file():
                raise MoeSpecError(f"{directory} has no {name}; is it a draft head saved by moe_spec?")
        config = _read_config(directory / CONFIG_FILE)
        with torch.device("meta"):
            skeleton = EagleHead(config)
        expected = {name: (tuple(t.shape), None) for name, t in skeleton.state_dict().items()}
        expected["draft_to_target"] = ((config.draft_vocab_size,), torch.int64)
        path = directory / WEIGHTS_FILE
        state = read_tensors(path, expected)
        not_float = sorted(k for k, v in state.items() if k != "draft_to_target" and not v.is_floating_point())
        if not_float:
            raise TensorFileError(f"{path}: weights {not_float[:5]} are not floating point")
        ids = state["draft_to_target"]
        if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < config.target_vocab_size):
            raise TensorFileError(f"{path}: draft_to_target holds ids outside the target vocabulary "
                                  f"0..{config.target_vocab_size - 1}")
        head = EagleHead(config, ids)
        head.load_state_dict({k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()})
        return head.to(dtype).eval()


_MAX_CONFIG_BYTES = 2**20


def _read_config(path: Path) -> EagleConfig:
    """`EagleConfig` from config.json, each field of the type its annotation names (ints positive,
    `intermediate_size` and feature layers >= 0); `MoeSpecError` naming the file otherwise."""
    if path.stat().st_size > _MAX_CONFIG_BYTES:
        raise MoeSpecError(f"{path} is {path.stat().st_size} bytes, too large for a draft head config")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise MoeSpecError(f"cannot read draft head config {path}: {error}") from None
    if not isinstance(raw, dict):
        raise MoeSpecError(f"{path} is not a JSON object (a draft head config is one)")
    fields_by_name = {f.name: f for f in fields(EagleConfig)}
    problems = []
    for name, value in raw.items():
        if name == "kind" or name not in fields_by_name:
            continue  # `from_json` names a wrong kind or unknown fields
        kind = fields_by_name[name].type
        if kind == "int":
            low = 0 if name == "intermediate_size" else 1
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= low):
                problems.append(f"{name} must be an integer >= {low}, got {value!r}")
        elif kind == "float":
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0):
                problems.append(f"{name} must be a positive number, got {value!r}")
        elif kind == "str":
            if not isinstance(value, str):
                problems.append(f"{name} must be a string, got {value!r}")
        elif not (isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value)):
            problems.append(f"{name} must be a list of layer indices >= 0, got {value!r}")
    if problems:
        raise MoeSpecError(f"draft head config {path}: {'; '.join(problems)}")
    try:
        return EagleConfig.from_json(json.dumps(raw))
    except MoeSpecError as error:
        raise MoeSpecError(f"draft head config {path}: {error}") from None
    except (TypeError, ValueError) as error:
        raise MoeSpecError(f"draft head config {path} is invalid: {error}") from None
