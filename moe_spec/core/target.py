"""The narrow interface moe_spec needs from a Hugging Face causal LM.

`TargetModel.forward_tree` runs one verification forward: a cached prefix plus N new tokens
whose visibility is given by a tree mask. It passes the model's own forward a float additive
4D mask `[B, 1, N, P + N]` (a bool mask is silently wrong under eager attention) and
`position_ids = P + depth`, and returns the logits, the hidden states a drafter needs and the
routing of the N tokens. A config's sliding window is applied as transformers applies it
(`AttentionWindow`): to every layer (Mistral, Mixtral, PhiMoE, Qwen3-MoE), or, through the dict
form of the mask, to the layers `config.layer_types` marks sliding (GPT-OSS, Qwen2-MoE). The
window is part of the mask because a 4D mask passed in is used as it is, and because moe_spec
keeps full caches (see `kv_cache.py`).

A plain autoregressive step (one new token that sees every cached column) needs no mask: the
model's own causal mask is the same, so none is built and attention runs unmasked, as in
`model.generate`. Hidden states are requested only when someone reads them (a drafter), and a
prefill can keep the last position's logits only.

Feature layer ids are indices into `hidden_states` as engines read them: id i < N is the input of
layer i, and id N is the last layer's output *before* the final norm (vLLM and speculators' meaning;
transformers' own `hidden_states[N]` is after it), read by a hook on the final norm's input. Id -1
is the state *after* the final norm, the one the output layer reads (`AFTER_FINAL_NORM`; what MTP
layers are fed, as transformers' `MTPCandidateGenerator` feeds them).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from moe_spec.core.architectures import ArchitectureSpec, architecture_of
from moe_spec.errors import UnsupportedArchitectureError
from moe_spec.core.routing import Routing, RoutingRecorder, find_routers

_MASKABLE_ATTENTION = ("eager", "sdpa")
AFTER_FINAL_NORM = -1  # feature id of the last hidden state after the final norm (transformers' hidden_states[-1])


@dataclass(frozen=True)
class FetchCounts:
    """What one forward read from an offloaded experts tier (see `moe_spec.offload`)."""

    hits: int  # (layer, expert) the pass needed and found resident
    misses: int  # (layer, expert) the pass had to read
    bytes_read: int
    wait_ms: float  # time the pass waited on reads
    per_layer_misses: tuple[int, ...] = ()  # M_l: experts each MoE layer read


@dataclass(frozen=True)
class TargetOutput:
    logits: torch.Tensor  # [B, N, V]; [B, 1, V] when only the last position's were asked for
    features: torch.Tensor | None  # [B, N, S, D]: hidden states of the S feature layers; None when not asked for
    routing: Routing  # experts [L, B*N, K], tokens in row-major (b, n) order
    fetch: FetchCounts | None = None  # None: the experts are not offloaded


@dataclass(frozen=True)
class AttentionWindow:
    """A sliding window as transformers' masks apply it: query position i sees key position j only
    when i - j < size (`masking_utils.sliding_window_overlay`)."""

    size: int
    by_layer_type: bool  # only the layers `config.layer_types` marks "sliding_attention" slide (dict mask)

    @staticmethod
    def of(config, spec: ArchitectureSpec) -> "AttentionWindow | None":
        """The window `config` gives this architecture, None where no layer slides."""
        size = getattr(config, "sliding_window", None)
        if not size:
            return None
        if spec.mask_by_layer_type:
            sliding = "sliding_attention" in (getattr(config, "layer_types", None) or ())
            return AttentionWindow(int(size), True) if sliding else None
        return AttentionWindow(int(size), False)


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """Low, middle and high hidden states (indices into `hidden_states`) for a new EAGLE-3 head: EAGLE's
    own choice, the inputs of layers 2, N // 2 and N - 3, where those are three distinct layers (N >= 7).
    A shallower target gets three distinct ids spread over its layers, ascending (vLLM captures each
    layer once, in ascending order). A drafter that fuses other layers, the last layer's output (id N,
    before the final norm) among them, sets `TargetModel.feature_layers` to its own."""
    if num_layers >= 7:
        return 2, num_layers // 2, num_layers - 3
    if num_layers <= 3:  # a one-layer target has two hidden states to fuse
        return tuple(range(min(3, num_layers + 1)))
    return 1, (num_layers + 1) // 2, num_layers - 1


def synchronize(device: torch.device) -> None:
    """Wait until `device` has run everything queued on it, so that a host clock read next covers that
    work (CUDA and other accelerators run kernels asynchronously); a no-op on the CPU."""
    if device.type not in ("cpu", "meta"):
        torch.accelerator.synchronize(device)


class TargetModel:
    """A transformers causal LM seen through the one operation speculative decoding needs."""

    def __init__(self, model: PreTrainedModel, feature_layers: tuple[int, ...] | None = None, offload=None):
        # offload: the `moe_spec.offload.ExpertOffload` installed on `model`, if any (its counters and
        # residency are read here and by controllers; nothing is stored on the model itself)
        self.offload = offload
        self.spec: ArchitectureSpec = architecture_of(model)
        attention = getattr(model.config, "_attn_implementation", None) or "eager"
        if attention not in _MASKABLE_ATTENTION:
            raise UnsupportedArchitectureError(
                f"attention implementation {attention!r} cannot take a tree mask; load the model with "
                f"attn_implementation in {_MASKABLE_ATTENTION}"
            )
        if self.spec.needs_eager_attention and attention != "eager":
            raise UnsupportedArchitectureError(
                f"{self.spec.model_type} must run with attn_implementation='eager' (got {attention!r})"
            )
        self.model = model
        self.config = model.config.get_text_config(decoder=True)
        self.num_layers = int(self.config.num_hidden_layers)
        self.feature_layers = feature_layers or default_feature_layers(self.num_layers)
        if max(self.feature_layers) > self.num_layers or min(self.feature_layers) < AFTER_FINAL_NORM:
            raise ValueError(f"feature layers {self.feature_layers} outside 0..{self.num_layers} "
                             f"(or {AFTER_FINAL_NORM}: after the final norm)")
        self._final_norm = getattr(model.get_decoder(), "norm", None)  # its input is feature id N
        self.routers = find_routers(model, self.spec)
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)
        self.max_positions = int(getattr(self.config, "max_position_embeddings", 0) or 0) or None
        self.window = AttentionWindow.of(self.config, self.spec)

    @property
    def sliding_window(self) -> int | None:
        """Keys a sliding layer's query sees, itself included; None where no layer slides."""
        return self.window.size if self.window is not None else None

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def synchronize(self) -> None:
        """Wait for the work queued on the model's device (see `synchronize`)."""
        synchronize(self.device)

    @property
    def is_moe(self) -> bool:
        return bool(self.routers)

    @property
    def num_experts(self) -> int:
        return self.routers[0].num_experts if self.routers else 0

    @property
    def top_k(self) -> int:
        return self.routers[0].top_k if self.routers else 0

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(r.layer for r in self.routers)

    def new_cache(self) -> DynamicCache:
        return DynamicCache()

    @torch.no_grad()
    def forward_tree(
        self,
        cache: DynamicCache,
        input_ids: torch.Tensor,  # [B, N] long
        tree_mask: torch.Tensor,  # [B, N, N] bool: node i sees node j
        position_ids: torch.Tensor,  # [B, N] long
        prefix_valid: torch.Tensor | None = None,  # [B, P] bool: cached positions a row may see
        features: bool = True,  # return the feature layers' hidden states (a drafter reads them)
        last_logits_only: bool = False,  # logits of the last position only (a prefill's next token)
    ) -> TargetOutput:
        # The mask is built on the host from the host-side layout (valid columns, tree mask,
        # positions: small tensors the engine keeps on the CPU) and moved to the device once.
        batch, n = input_ids.shape
        prefix_len = cache.get_seq_length()
        if prefix_valid is None:
            prefix_valid = torch.ones(batch, prefix_len, dtype=torch.bool)
        if prefix_valid.shape != (batch, prefix_len):
            raise ValueError(f"prefix_valid has shape {tuple(prefix_valid.shape)}, expected {(batch, prefix_len)}")
        visible = torch.cat([prefix_valid[:, None, :].expand(batch, n, prefix_len), tree_mask], dim=-1)  # [B, N, P+N]
        window = self.window
        if n == 1 and bool(visible.all()) and (window is None or prefix_len + 1 <= window.size):
            attention_mask = None  # one token seeing every column: the model's causal mask hides nothing either
        elif window is None:
            attention_mask = self._additive(visible)
        else:
            # positions of the cached keys count the row's valid columns (left padding and holes skipped)
            key_positions = torch.cat([prefix_valid.long().cumsum(-1) - 1, position_ids.cpu()], dim=-1)  # [B, P+N]
            in_window = (position_ids.cpu()[:, :, None] - key_positions[:, None, :]) < window.size  # [B, N, P+N]
            sliding = self._additive(visible & in_window)
            attention_mask = ({"full_attention": self._additive(visible), "sliding_attention": sliding}
                              if window.by_layer_type else sliding)
        device = self.device
        before = self.offload.counters.copy() if self.offload is not None else None
        with RoutingRecorder(self.model, self.spec, self.routers) as recorder, self.reading_features(features) as read:
            out = self.model(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask,
                position_ids=position_ids.to(device),
                past_key_values=cache,
                use_cache=True,
                output_hidden_states=features,
                logits_to_keep=1 if last_logits_only else 0,
            )
        hidden = read(out) if features else None  # [B, N, S, D]
        fetch = None
        if before is not None:
            done = self.offload.counters.since(before)
            fetch = FetchCounts(done.hits, done.misses, done.bytes_read, done.wait_ms, tuple(done.per_layer_misses))
        return TargetOutput(logits=out.logits, features=hidden, routing=recorder.routing(), fetch=fetch)

    @contextmanager
    def reading_features(self, active: bool = True):
        """Around a forward of `self.model` with `output_hidden_states=True`: yields `read(out)`, the
        feature layers' states `[B, T, S, D]` of that forward, id N taken before the final norm."""
        captured: list[torch.Tensor] = []
        hook = None
        if active and self.num_layers in self.feature_layers:
            if self._final_norm is None:
                raise UnsupportedArchitectureError(
                    f"feature layer {self.num_layers} is the last layer's output before the final norm, and "
                    f"{type(self.model).__name__} has no `norm` module on its decoder to read it from")
            hook = self._final_norm.register_forward_pre_hook(lambda module, args: captured.append(args[0]))

        def read(out) -> torch.Tensor:
            states = list(out.hidden_states)
            if hook is not None:
                states[self.num_layers] = captured[-1]  # [B, T, D] before the final norm
            states.append(out.hidden_states[-1])  # index -1: after the final norm
            return torch.stack([states[i] for i in self.feature_layers], dim=2)

        try:
            yield read
        finally:
            if hook is not None:
                hook.remove()

    def _additive(self, visible: torch.Tensor) -> torch.Tensor:
        """[B, N, K] bool -> [B, 1, N, K] float mask: 0 where visible, dtype-min elsewhere."""
        mask = torch.zeros(visible.shape, dtype=self.dtype)
        mask.masked_fill_(~visible, torch.finfo(self.dtype).min)
        return mask[:, None].to(self.device)
