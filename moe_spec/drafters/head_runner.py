"""`HeadRunner`: the inference-only forward of an `EagleHead` for B independent rows at once.

The same math as `EagleHead.forward`, written out op by op without HF's module, mask and cache
plumbing (at a drafter's sizes that plumbing, not arithmetic, was most of the cost): q/k/v and
gate/up each in one matmul, rotary cos/sin looked up in a table computed once by the head's own
rotary module, RMSNorm as `F.rms_norm` (bitwise equal in float32). Training keeps using
`EagleHead.forward`; `tests/drafters/test_head_runner.py` holds the two together.

Keys and values live in one `[B, H_kv, capacity, head_dim]` buffer per layer, written by index
(gpt-fast style): row b's first `lengths[b]` columns are its committed pairs; anything past them
is scratch that the next write overwrites, so dropping drafts is just not advancing `lengths`. A
single sequence is a batch of one.

- `write` appends pairs whose output is never read (a prompt's): in a one-layer head their keys
  and values alone (they depend on each pair's own input only); deeper heads run every layer but
  the last in full first;
- `extend` appends each row's pairs causally at that row's own columns `lengths[b]...` and
  returns the output of each row's last pair only: the other pairs' output is never read (a later
  pair reads the target's features), so the last layer's attention and MLP skip them;
- `draft` writes all rows' tree nodes at one shared column range past every row's prefix; its
  additive mask opens row b's prefix columns (`prefix_mask`) and the tree columns of its
  ancestors, so the gap between a shorter row's prefix and the tree stays hidden.

Rows differ in length, so a forward carries an additive mask per row, but only where they do:
rows that share one column range (always so for a single sequence) are written by slice and
attend unmasked, which keeps a batch of one as cheap as a dedicated single-row path.

Fused weights are copies, rebuilt when any head parameter changes (`refresh`, checked on every
`EagleDrafter` call), so training a head that a drafter wraps stays safe.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from moe_spec.drafters.eagle_head import EagleHead


@dataclass
class _Layer:
    """One decoder layer's weights, fused for the runner."""

    qkv_w: torch.Tensor  # [(H + 2 H_kv) hd, D_in]: D_in = 2D for the first layer
    qkv_b: torch.Tensor | None
    o_w: torch.Tensor  # [D, H hd]
    o_b: torch.Tensor | None
    gate_up_w: torch.Tensor  # [2 I, D]
    gate_up_b: torch.Tensor | None
    down_wt: torch.Tensor  # [I, D]: mm beats linear at these shapes
    down_b: torch.Tensor | None
    norm_in: tuple  # (weight, eps)
    norm_post: tuple
    q_norm: tuple | None  # qwen3-style, over head_dim
    k_norm: tuple | None


def _bias(module: nn.Linear) -> torch.Tensor | None:
    return module.bias.detach() if module.bias is not None else None


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float, fast: bool) -> torch.Tensor:
    """LlamaRMSNorm; in float32 `F.rms_norm` is the same arithmetic in one op."""
    if fast and x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


class HeadRunner:
    def __init__(self, head: EagleHead, embed: nn.Module, batch: int = 1):
        self.head = head
        self.embed = head.embedding(embed)
        self.lengths = [0] * batch  # committed key/value columns per row (ints: every use is host-side)
        self.rows_extended = 0  # pairs run by `extend` (committed pairs and root pairs)
        self.rows_drafted = 0  # rows run by `draft` (expanded tree nodes, placeholders included)
        self._params: list[torch.Tensor] = []
        self._key = None
        self._k: list[torch.Tensor] | None = None  # per layer [B, H_kv, capacity, head_dim]
        self._v: list[torch.Tensor] | None = None
        self._cos = self._sin = None  # [positions, head_dim]

    # -- state ------------------------------------------------------------------------------

    @property
    def batch(self) -> int:
        return len(self.lengths)

    def reset(self, batch: int) -> None:
        """Forget every row and start `batch` empty ones."""
        self.lengths = [0] * batch
        if self._k is not None and self._k[0].shape[0] != batch:
            self._k = self._v = None

    def keep_rows(self, rows: list[int]) -> None:
        """Keep only these rows (indices into the current batch), in this order."""
        self.lengths = [self.lengths[i] for i in rows]
        if self._k is not None:
            index = torch.tensor(rows, device=self._k[0].device)
            self._k, self._v = [k[index] for k in self._k], [v[index] for v in self._v]

    def _state_key(self) -> tuple:
        return tuple(p.data_ptr() for p in self._params) + tuple(p._version for p in self._params)

    def refresh(self) -> None:
        """(Re)build the fused weights if the head's parameters were updated, replaced, moved or cast."""
        if self._key is not None and self._state_key() == self._key:
            return
        head = self.head
        self._params = [p for p in head.parameters()] + [self.embed.weight]
        dtype, device = head.dtype, head.fc.weight.device
        self.dtype, self.device = dtype, device
        first = head.layers[0].self_attn
        self.num_heads = first.config.num_attention_heads
        self.head_dim = first.head_dim
        self.num_kv_heads = first.k_proj.out_features // self.head_dim
        self.scaling = first.scaling
        self.intermediate = head.layers[0].mlp.intermediate_size
        act = head.layers[0].mlp.act_fn
        self.act = F.silu if type(act).__name__ == "SiLUActivation" else act  # skips a module call
        with torch.no_grad():
            self.layers = [self._fused(layer) for layer in head.layers]
        self.hidden_norm = (head.layers[0].hidden_norm.weight.detach(), head.layers[0].hidden_norm.variance_epsilon)
        self.out_norm = (head.norm.weight.detach(), head.norm.variance_epsilon)
        self.norm_before_residual = head.config.norm_before_residual
        self.norm_output = head.config.norm_output
        self.logits_norm = head.config.logits_norm and not head.config.norm_output  # as `EagleHead.logits`
        self.lm_w = head.lm_head.weight.detach()
        norms = [self.hidden_norm, self.out_norm] + [n for layer in self.layers for n in (layer.norm_in, layer.norm_post)]
        self._fast_norm = dtype == torch.float32 and all(w.dtype == torch.float32 for w, _ in norms)
        self.embed_w = self.embed.weight.detach()
        self.d2t = head.draft_to_target
        self.draft_vocab = head.config.draft_vocab
        self._cos = self._sin = None
        if self._k is not None and (self._k[0].dtype != dtype or self._k[0].device != device or len(self._k) != len(self.layers)):
            self._k = self._v = None
            self.lengths = [0] * self.batch
        self._key = self._state_key()

    @staticmethod
    def _fused(layer) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        biases = [_bias(m) for m in (attn.q_proj, attn.k_proj, attn.v_proj)]
        qkv_b = None if all(b is None for b in biases) else torch.cat(
            [b if b is not None else torch.zeros(m.out_features, dtype=m.weight.dtype, device=m.weight.device)
             for b, m in zip(biases, (attn.q_proj, attn.k_proj, attn.v_proj))])
        gate_up_b = None
        if mlp.gate_proj.bias is not None:
            gate_up_b = torch.cat([mlp.gate_proj.bias, mlp.up_proj.bias]).detach()
        q_norm = getattr(attn, "q_norm", None)
        k_norm = getattr(attn, "k_norm", None)
        return _Layer(
            qkv_w=torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
            qkv_b=qkv_b, o_w=attn.o_proj.weight.detach(), o_b=_bias(attn.o_proj),
            gate_up_w=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), gate_up_b=gate_up_b,
            down_wt=mlp.down_proj.weight.t().contiguous(), down_b=_bias(mlp.down_proj),
            norm_in=(layer.input_layernorm.weight.detach(), layer.input_layernorm.variance_epsilon),
            norm_post=(layer.post_attention_layernorm.weight.detach(), layer.post_attention_layernorm.variance_epsilon),
            q_norm=(q_norm.weight.detach(), q_norm.variance_epsilon) if q_norm is not None else None,
            k_norm=(k_norm.weight.detach(), k_norm.variance_epsilon) if k_norm is not None else None,
        )

    def reserve(self, columns: int) -> None:
        """Make room for `columns` columns in every row, keeping everything written so far."""
        if self._k is not None and self._k[0].shape[2] >= columns:
            return
        old = self._k[0].shape[2] if self._k is not None else 0
        capacity = max(columns, 2 * old, 256)
        shape = (self.batch, self.num_kv_heads, capacity, self.head_dim)
        ks = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        vs = [torch.zeros_like(k) for k in ks]
        if old:
            for new, kept in zip(ks + vs, self._k + self._v):
                new[:, :, :old] = kept
        self._k, self._v = ks, vs

    def _rotary(self, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin [>= positions, head_dim], from the head's own rotary module.

        The sin table has its first half negated, so `x * cos + swap_halves(x) * sin` is exactly
        HF's `x * cos + rotate_half(x) * sin` (a sign flip is exact; the table's entries are the
        module's, computed elementwise from the position).
        """
        if self._cos is None or self._cos.shape[0] < positions:
            n = max(positions, 2 * (self._cos.shape[0] if self._cos is not None else 512))
            probe = torch.empty(0, dtype=self.dtype, device=self.device)
            cos, sin = self.head.rotary(probe, torch.arange(n, device=self.device)[None])
            half = self.head_dim // 2
            self._cos, self._sin = cos[0], torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)
        return self._cos, self._sin

    def _closed_beyond(self, visible: list[int], columns: int) -> torch.Tensor:
        """[B, columns] additive mask: 0 for columns < visible[b], dtype-min after."""
        open_ = torch.arange(columns, device=self.device)[None] < torch.tensor(visible, device=self.device)[:, None]
        return torch.zeros(open_.shape, dtype=self.dtype, device=self.device).masked_fill_(~open_, torch.finfo(self.dtype).min)

    def prefix_mask(self, visible: list[int]) -> torch.Tensor:
        """[B, P] additive mask over the columns before a tree (P = max(visible)): row b sees its
        first visible[b]. A tree's rows' masks start from it."""
        columns = max(visible)
        if all(v == columns for v in visible):
            return torch.zeros(len(visible), columns, dtype=self.dtype, device=self.device)
        return self._closed_beyond(visible, columns)

    # -- math (mirrors EagleHead.forward / transformers' decoder layers) ----------------------

    def _norm(self, norm: tuple, x: torch.Tensor) -> torch.Tensor:
        return _rms(x, norm[0], norm[1], self._fast_norm)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """[M, D] -> [M, V_draft], as `EagleHead.logits`."""
        return F.linear(self._norm(self.out_norm, x) if self.logits_norm else x, self.lm_w)

    def _fed_back(self, x: torch.Tensor) -> torch.Tensor:
        """As `EagleHead.fed_back`."""
        return self._norm(self.out_norm, x) if self.norm_output else x

    def _first_input(self, g: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """g [N, D], target ids [N] -> (the first layer's q/k/v input [N, 2D], its residual [N, D])."""
        embeds = self.embed_w.index_select(0, token_ids).to(self.dtype)
        normed_g = self._norm(self.hidden_norm, g.to(self.dtype))
        both = torch.cat([self._norm(self.layers[0].norm_in, embeds), normed_g], dim=-1)
        return both, (normed_g if self.norm_before_residual else g.to(self.dtype))

    # Matmuls run on [B*M, D] rows (a 3-D linear costs more at these sizes); attention on [B, H, M, hd].

    def _qkv(self, i: int, inp: torch.Tensor, b: int, cos: torch.Tensor, sin: torch.Tensor):
        """Layer i's normed input [B*M, D_in]; cos/sin [hd] (one position for all), [M, hd] (per
        column, shared by the rows) or [B, M, hd] -> q [B, H, M, hd], k, v [B, H_kv, M, hd], rotary
        applied to q and k."""
        layer = self.layers[i]
        n, h, kv, hd = inp.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        m = n // b
        qkv = F.linear(inp, layer.qkv_w, layer.qkv_b)  # [B*M, (H + 2 H_kv) hd]
        qk = qkv[:, : (h + kv) * hd]
        if layer.q_norm is not None:  # per head, before rotary (qwen3)
            q, k = qk.view(n, h + kv, hd).split([h, kv], dim=1)
            qk = torch.cat([self._norm(layer.q_norm, q), self._norm(layer.k_norm, k)], dim=1)
        qk = qk.reshape(b, m, h + kv, 2, hd // 2)
        swapped = qk.flip(-2).view(b, m, h + kv, hd)  # rotate_half up to the sign, which `sin` carries
        if cos.dim() > 1:  # broadcast over the heads
            cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        qk = (qk.view(b, m, h + kv, hd) * cos + swapped * sin).transpose(1, 2)  # [B, H + H_kv, M, hd]
        return qk[:, :h], qk[:, h:], qkv[:, (h + kv) * hd:].view(b, m, kv, hd).transpose(1, 2)

    def _finish(self, i: int, residual: torch.Tensor, q: torch.Tensor, columns: int,
                mask: torch.Tensor | None) -> torch.Tensor:
        """Layer i: residual [B*M, D], q [B, H, M, hd] over the first `columns` buffered keys
        (additive mask [B or 1, 1, M, columns], None: all visible), then o_proj, MLP, residuals -> [B*M, D]."""
        layer = self.layers[i]
        out = F.scaled_dot_product_attention(
            q, self._k[i][:, :, :columns], self._v[i][:, :, :columns], attn_mask=mask, scale=self.scaling,
            enable_gqa=self.num_kv_heads != self.num_heads)  # [B, H, M, hd]
        x = residual + F.linear(out.transpose(1, 2).reshape(residual.shape[0], -1), layer.o_w, layer.o_b)
        gate, up = F.linear(self._norm(layer.norm_post, x), layer.gate_up_w, layer.gate_up_b).split(self.intermediate, dim=-1)
        down = torch.mm(self.act(gate) * up, layer.down_wt)
        return x + (down if layer.down_b is None else down + layer.down_b)

    def _layer_input(self, i: int, x: torch.Tensor) -> torch.Tensor:
        return self._norm(self.layers[i].norm_in, x)

    # -- the three kinds of forward -------------------------------------------------------------

    def write(self, g: list[torch.Tensor], token_ids: list[torch.Tensor]) -> None:
        """Append each row's pairs (g[b] [A_b, D], target ids [A_b], A_b >= 0) whose output nobody
        reads (a prompt's pairs, written when decoding begins); `lengths` advance by A_b."""
        counts = [t.numel() for t in token_ids]
        if not sum(counts):
            return
        if len(self.layers) > 1:  # deeper layers' keys depend on attention: the causal forward, unread
            self._causal(g, token_ids, counts, last_output=False)
            return
        starts = self.lengths
        self.lengths = [s + c for s, c in zip(starts, counts)]
        self.reserve(max(self.lengths))
        cos, sin = self._rotary(max(self.lengths))
        rows = torch.cat([torch.full((c,), b, device=self.device) for b, c in enumerate(counts)])  # [A] each pair's row
        columns = torch.cat([torch.arange(s, s + c, device=self.device) for s, c in zip(starts, counts)])  # [A]
        both, _ = self._first_input(torch.cat(g), torch.cat(token_ids).to(self.device))  # every row's pairs in one run
        _, k, v = self._qkv(0, both, 1, cos[columns], sin[columns])  # [1, H_kv, A, hd]
        self._k[0][rows, :, columns] = k[0].transpose(0, 1)  # [A, H_kv, hd]
        self._v[0][rows, :, columns] = v[0].transpose(0, 1)
        self.rows_extended += sum(counts)

    def extend(self, g: list[torch.Tensor], token_ids: list[torch.Tensor]) -> torch.Tensor:
        """Append each row's pairs (g[b] [A_b, D], target ids [A_b], A_b >= 1) causally after its
        committed columns. Returns the output [B, D] of each row's last pair; `lengths` advance by A_b."""
        counts = [t.numel() for t in token_ids]
        if min(counts) < 1:
            raise ValueError(f"HeadRunner.extend: every row needs a pair whose output it returns, got counts {counts} "
                             "(pairs nobody reads go in by `write`)")
        return self._causal(g, token_ids, counts, last_output=True)

    def _causal(self, g: list[torch.Tensor], token_ids: list[torch.Tensor], counts: list[int],
                last_output: bool) -> torch.Tensor | None:
        """Each row's pairs at its own columns, every layer causal; the last layer's attention and MLP
        only for each row's last pair (`last_output`), or not at all."""
        b, a = len(counts), max(counts)
        starts = self.lengths
        self.lengths = [s + c for s, c in zip(starts, counts)]
        end, written = max(self.lengths), max(starts) + a  # a shorter row's padding lands past its end
        self.reserve(written)
        cos, sin = self._rotary(written)
        uniform = len(set(starts)) == 1 and len(set(counts)) == 1  # one column range for every row
        deep = len(self.layers) > 1  # layers before the last attend for every pair
        if uniform:
            start = starts[0]
            both, residual = self._first_input(torch.cat(g), torch.cat(token_ids))  # [B*A, 2D], [B*A, D]
            cos, sin = cos[start:end], sin[start:end]
            if deep:  # pair j (column start + j) sees columns <= start + j
                causal = self._closed_beyond(list(range(start + 1, end + 1)), end)[None, None]  # [1, 1, A, end]
        else:
            both, residual = self._first_input(nn.utils.rnn.pad_sequence(g, batch_first=True).flatten(0, 1),
                                               nn.utils.rnn.pad_sequence(token_ids, batch_first=True).flatten())
            columns = torch.tensor(starts, device=self.device)[:, None] + torch.arange(a, device=self.device)  # [B, A]
            cos, sin = cos[columns], sin[columns]
            rows = torch.arange(b, device=self.device)
            if deep:  # pair j of row b (column starts[b] + j) sees columns <= starts[b] + j
                open_ = torch.arange(written, device=self.device) < (columns + 1)[..., None]  # [B, A, written]
                causal = torch.zeros(open_.shape, dtype=self.dtype, device=self.device).masked_fill_(
                    ~open_, torch.finfo(self.dtype).min)[:, None]  # [B, 1, A, written]
        inp, x, last = both, residual, len(self.layers) - 1
        for i in range(len(self.layers)):
            q, k, v = self._qkv(i, inp, b, cos, sin)  # [B, H, A, hd]
            if uniform:
                self._k[i][:, :, start:end] = k
                self._v[i][:, :, start:end] = v
            else:  # advanced indices around a slice put their dims first: the target view is [B, A, H_kv, hd]
                self._k[i][rows[:, None], :, columns] = k.transpose(1, 2)
                self._v[i][rows[:, None], :, columns] = v.transpose(1, 2)
            if i < last:
                x = self._finish(i, x, q, causal.shape[-1], causal)  # [B*A, D]
                inp = self._layer_input(i + 1, x)
        self.rows_extended += sum(counts)
        if not last_output:
            return None
        if uniform:
            x_last, q_last, mask = x.view(b, a, -1)[:, -1], q[:, :, -1:], None
        else:
            index = torch.tensor(counts, device=self.device) - 1  # [B] each row's last pair
            x_last, q_last = x.index_select(0, rows * a + index), q[rows, :, index][:, :, None]
            mask = self._closed_beyond(self.lengths, end)[:, None, None]  # [B, 1, 1, end]
        return self._fed_back(self._finish(last, x_last, q_last, end, mask))  # x_last [B, D], q_last [B, H, 1, hd]

    def draft(self, g: torch.Tensor, token_ids: torch.Tensor, positions: list[int], mask: torch.Tensor,
              depth: int = 1) -> torch.Tensor:
        """M tree rows per batch row (g [B, M, D], target ids [B, M]), row b's at positions[b],
        written to the last M of the C columns that mask [B, M, C] (additive: 0 or dtype-min)
        covers: each row's prefix and the tree drafted so far. Returns the outputs [B, M, D].
        `depth` (the nodes' tree depth) does not matter to an EAGLE head: every depth runs all its layers."""
        b, m = token_ids.shape
        columns = mask.shape[2]
        self.reserve(columns)
        cos, sin = self._rotary(max(positions) + 1)
        if len(set(positions)) == 1:
            cos, sin = cos[positions[0]], sin[positions[0]]  # [hd] for every row
        else:
            at = torch.tensor(positions, device=self.device)
            cos, sin = cos[at][:, None], sin[at][:, None]  # [B, 1, hd]
        inp, x = self._first_input(g.reshape(b * m, -1), token_ids.reshape(-1))  # [B*M, 2D], [B*M, D]
        for i in range(len(self.layers)):
            q, k, v = self._qkv(i, inp, b, cos, sin)  # [B, H, M, hd]
            self._k[i][:, :, columns - m: columns] = k
            self._v[i][:, :, columns - m: columns] = v
            x = self._finish(i, x, q, columns, mask[:, None])
            if i + 1 < len(self.layers):
                inp = self._layer_input(i + 1, x)
        self.rows_drafted += b * m
        return self._fed_back(x).view(b, m, -1)
