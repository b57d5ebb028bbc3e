"""`EagleHead`: the EAGLE-3 draft head as the field publishes it (EAGLE, SpecForge, speculators, vLLM).

A pair t = (target features of position t, token t+1) gives the distribution of token t+2:

    g_t = fc(cat(h_low, h_mid, h_high)_t)            # [3 Ht] -> [H] (`fused`); fc_norm(g) on heads with one
    a_t = attn(q, k, v = proj(cat(input_layernorm(embed(token_{t+1})), hidden_norm(g_t))))  # q/k/v see 2H
    x_t = r_t + o_proj(a_t)                           # r_t = g_t (or hidden_norm(g_t): norm_before_residual)
    x_t = x_t + mlp(post_attention_layernorm(x_t))    # layer 0; further layers are plain decoder layers
    logits_t = lm_head(norm(x_t))                     # over the draft vocabulary

Where the target's features of a position are unknown (drafted tokens), `x` of the pair before it --
the last layer's output before `norm` -- stands in for `g` (fc skipped), as every implementation
does at inference and in training-time test.

The token embedding is the head's own `embed_tokens` where its file has one, else the target's
input embedding (passed in at call time, never trained or saved). The output projection covers
the draft vocabulary; the `draft_to_target` buffer maps a draft id to the target's token id (the
files' `d2t` holds the offsets `target - draft`).

The modules are transformers' own (`LlamaDecoderLayer`, or `Qwen3DecoderLayer` for q/k norms); the
first layer's q/k/v projections are widened to 2H and it gets a `hidden_norm`, so the state dict
names are speculators' (`layers.0.self_attn.q_proj.weight`, `layers.0.hidden_norm.weight`, ...).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

from moe_spec.drafters.eagle_config import EagleConfig
from moe_spec.errors import DraftHeadMismatchError


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., Q, K] bool -> [..., 1, Q, K] float: 0 where visible, dtype-min elsewhere (bool is wrong under eager)."""
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    mask.masked_fill_(~visible, torch.finfo(dtype).min)
    return mask.unsqueeze(-3)


class EagleHead(nn.Module):
    def __init__(self, config: EagleConfig, draft_to_target: torch.Tensor | None = None, with_embedding: bool = False):
        super().__init__()
        self.config = config
        layer_config = config.layer_config()
        h, eps = config.hidden_size, layer_config.rms_norm_eps
        self.embed_tokens = nn.Embedding(config.vocab_size, h) if with_embedding else None
        s, ht = config.num_feature_layers, config.fused_size
        self.input_norm = LlamaRMSNorm(s * ht, eps=eps) if config.norm_before_fc else None
        self.fc_norm = nn.ModuleList(LlamaRMSNorm(ht, eps=eps) for _ in range(s)) if config.fc_norm else None
        self.fc = nn.Linear(s * ht, h, bias=False)
        layer_kind = Qwen3DecoderLayer if config.qk_norm else LlamaDecoderLayer
        self.layers = nn.ModuleList(layer_kind(layer_config, layer_idx=i) for i in range(config.num_layers))
        first = self.layers[0]
        attention = first.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):
            old = getattr(attention, name)
            setattr(attention, name, nn.Linear(2 * h, old.out_features, bias=old.bias is not None))
        first.hidden_norm = LlamaRMSNorm(h, eps=eps)
        self.rotary = LlamaRotaryEmbedding(layer_config)
        self.norm = LlamaRMSNorm(h, eps=eps)
        self.lm_head = nn.Linear(h, config.draft_vocab, bias=False)
        if draft_to_target is None:
            draft_to_target = torch.arange(config.draft_vocab)
        if draft_to_target.shape != (config.draft_vocab,):
            raise ValueError(f"draft_to_target must have shape [{config.draft_vocab}], got {list(draft_to_target.shape)}")
        self.register_buffer("draft_to_target", draft_to_target.long().clone(), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def check_fits(self, target) -> None:
        """Raise `DraftHeadMismatchError` naming every field where this head and a `TargetModel` differ."""
        config, problems = self.config, []
        text = target.config
        if config.vocab_size != target.vocab_size:
            problems.append(f"vocab_size: head has {config.vocab_size}, target has {target.vocab_size}")
        if config.fused_size != int(text.hidden_size):
            problems.append(f"target_hidden_size: head fuses {config.fused_size}-wide layers, target's hidden size is "
                            f"{int(text.hidden_size)}")
        if self.embed_tokens is None and config.hidden_size != int(text.hidden_size):
            problems.append(f"hidden_size: head is {config.hidden_size} wide and has no embed_tokens of its own, "
                            f"so it needs the target's embedding, {int(text.hidden_size)} wide")
        layers = config.feature_layers_for(target.num_layers)
        if min(layers) < 0 or max(layers) > target.num_layers:
            named = "aux layers" if config.aux_layers else "aux layers (EAGLE's default, the head names none)"
            problems.append(f"{named} {list(layers)}: the target has hidden states 0..{target.num_layers}")
        if problems:
            raise DraftHeadMismatchError("draft head does not fit this target; " + "; ".join(problems))

    def embedding(self, target_embedding: nn.Module) -> nn.Module:
        """The module that embeds the pairs' tokens: the head's own, else the target's."""
        return self.embed_tokens if self.embed_tokens is not None else target_embedding

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """[..., S, Ht] target features -> [..., H]: g, which the head's own output may replace."""
        features = features.to(self.dtype)
        if self.fc_norm is not None:  # each layer on its own scale
            features = torch.stack([norm(features[..., i, :]) for i, norm in enumerate(self.fc_norm)], dim=-2)
        flat = features.flatten(-2)  # [..., S Ht]: low, mid, high
        if self.input_norm is not None:
            flat = self.input_norm(flat)
        return self.fc(flat)

    def fed_back(self, x: torch.Tensor) -> torch.Tensor:
        """The last layer's output -> what the head returns and deeper drafts read as `g`."""
        return self.norm(x) if self.config.norm_output else x

    def forward(
        self,
        g: torch.Tensor,  # [B, N, H]: fused target features, or the head's own x of the pair before
        token_embeds: torch.Tensor,  # [B, N, H]: embeddings of the pairs' tokens
        attention_mask: torch.Tensor,  # [B, 1, N, P + N] float additive
        position_ids: torch.Tensor,  # [B, N] long
        cache: DynamicCache,  # P positions before the call, P + N after, in every layer
    ) -> torch.Tensor:
        """[B, N, H]: the last layer's output (pre-norm; normed with `norm_output`), fed back as `g`
        for deeper drafts."""
        dtype = self.dtype
        first = self.layers[0]
        g, token_embeds, mask = g.to(dtype), token_embeds.to(dtype), attention_mask.to(dtype)
        rotary = self.rotary(g, position_ids)
        normed_g = first.hidden_norm(g)
        residual = normed_g if self.config.norm_before_residual else g
        both = torch.cat([first.input_layernorm(token_embeds), normed_g], dim=-1)  # [B, N, 2H]
        attended, _ = first.self_attn(hidden_states=both, attention_mask=mask, position_ids=position_ids,
                                      past_key_values=cache, use_cache=True, position_embeddings=rotary)
        x = residual + attended
        x = x + first.mlp(first.post_attention_layernorm(x))
        for layer in self.layers[1:]:
            x = layer(x, attention_mask=mask, position_ids=position_ids, past_key_values=cache, use_cache=True,
                      position_embeddings=rotary)
        return self.fed_back(x)

    def unroll(self, features: torch.Tensor, token_embeds: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """The training-time test (EAGLE-3): `steps` passes over a sequence, pass k feeding on pass k-1.

        features: [B, T, S, Ht] target features; token_embeds: [B, T, H] of the same T tokens.
        Returns `steps` tensors [B, T-1, H]: x of pair t = (position t, token t+1) at pass k.
        Pass 0 reads the target's features; pass k > 0 reads x of pass k-1 at t-1 in their place,
        which is what a node at depth k+1 of a draft tree reads. Its attention sees what that node
        sees at inference: pass-0 keys up to t-k (committed pairs and the root pair) and one key of
        each pass j = 1..k at t-k+j (its drafted ancestors and itself). Outputs at t < k have no
        such context and carry no meaning.
        """
        batch, n = features.shape[0], features.shape[1] - 1
        g = self.fuse(features[:, :-1])  # [B, n, H]
        embeds = token_embeds[:, 1:]  # [B, n, H]
        t = torch.arange(n, device=features.device)
        positions = t[None].expand(batch, n)
        cache = DynamicCache()
        outputs = []
        for k in range(steps):
            blocks = [t[None, :] <= t[:, None] - k] + [t[None, :] == t[:, None] - k + j for j in range(1, k + 1)]
            mask = additive_mask(torch.cat(blocks, dim=-1)[None], self.dtype)  # [1, 1, n, (k+1) n]
            x = self(g, embeds, mask, positions, cache)  # [B, n, H]
            outputs.append(x)
            g = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)  # position t reads x at t-1
        return outputs

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """[..., H] the head's output -> [..., V_draft] logits over the draft vocabulary."""
        normed = self.config.norm_output or not self.config.logits_norm  # fed back normed, or no norm at all
        return self.lm_head(x if normed else self.norm(x))

    def save_pretrained(self, directory, dtype: torch.dtype = torch.bfloat16) -> None:
        """The speculators layout (vLLM serves it with `method: eagle3`); see `head_layouts`."""
        from moe_spec.drafters.head_layouts import save_head

        save_head(self, directory, "speculators", dtype=dtype)

    @staticmethod
    def from_pretrained(directory, dtype: torch.dtype = torch.float32) -> "EagleHead":
        """A head from a local folder in any layout `head_layouts` reads, the layout detected from its
        config.json; refused before any weight is allocated if the files do not fit together."""
        from moe_spec.drafters.head_layouts import load_head

        return load_head(directory, dtype=dtype)
