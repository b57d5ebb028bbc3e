"""`HeadRunner`: the inference-only forward of an `EagleHead` for B independent rows at once.

The same math as `EagleHead.forward`, written out op by op without HF's module, mask and cache
plumbing (at a drafter's sizes that plumbing, not arithmetic, was most of the cost): q/k/v and
gate/up each in one matmul, rotary cos/sin looked up in a table computed once by the head's own
rotary module, RMSNorm as `F.rms_norm` (bitwise equal in float32). Training keeps using
`EagleHead.forward`; `tests/drafters/test_head_runner.py` holds the two together.

Keys and values live in `[B, H, capacity, head_dim]` buffers written by index (gpt-fast style):
row b's first `lengths[b]` columns are its committed pairs; anything past them is scratch that
the next write overwrites, so dropping drafts is just not advancing `lengths`. A single sequence
is a batch of one.

- `write` appends pairs whose h is never read (a prompt's): their keys and values alone;
- `extend` appends each row's pairs causally at that row's own columns `lengths[b]...` and
  returns the h of each row's last pair only: the other pairs' h is never read (a later pair
  reads the target's features, not h), so their attention and MLP are skipped;
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

import torch
from torch import nn
from torch.nn import functional as F

from moe_spec.drafters.eagle_head import EagleHead


class HeadRunner:
    def __init__(self, head: EagleHead, embed: nn.Module, batch: int = 1):
        self.head = head
        self.embed = embed
        self.lengths = [0] * batch  # committed key/value columns per row (ints: every use is host-side)
        self.rows_extended = 0  # pairs run by `extend` (committed pairs and root pairs)
        self.rows_drafted = 0  # rows run by `draft` (expanded tree nodes, placeholders included)
        self._params: list[torch.Tensor] = []
        self._key = None
        self._k = self._v = None  # [B, H, capacity, head_dim]
        self._cos = self._sin = None  # [positions, head_dim]

    # -- state ------------------------------------------------------------------------------

    @property
    def batch(self) -> int:
        return len(self.lengths)

    def reset(self, batch: int) -> None:
        """Forget every row and start `batch` empty ones."""
        self.lengths = [0] * batch
        if self._k is not None and self._k.shape[0] != batch:
            self._k = self._v = None

    def keep_rows(self, rows: list[int]) -> None:
        """Keep only these rows (indices into the current batch), in this order."""
        self.lengths = [self.lengths[i] for i in rows]
        if self._k is not None:
            index = torch.tensor(rows, device=self._k.device)
            self._k, self._v = self._k[index], self._v[index]

    def _state_key(self) -> tuple:
        return tuple(p.data_ptr() for p in self._params) + tuple(p._version for p in self._params)

    def refresh(self) -> None:
        """(Re)build the fused weights if the head's parameters were updated, replaced, moved or cast."""
        if self._key is not None and self._state_key() == self._key:
            return
        head = self.head
        layer, attn, mlp = head.layer, head.layer.self_attn, head.layer.mlp
        projections = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        if any(m.bias is not None for m in projections):
            raise NotImplementedError("HeadRunner assumes bias-free projections, as EagleConfig builds them")
        self._params = [p for p in head.parameters()] + [self.embed.weight]
        dtype, device = head.proj.weight.dtype, head.proj.weight.device
        self.dtype, self.device = dtype, device
        self.num_heads = head.config.num_attention_heads
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling
        self.intermediate = mlp.intermediate_size
        self.act = F.silu if type(mlp.act_fn).__name__ == "SiLUActivation" else mlp.act_fn  # skips a module call
        with torch.no_grad():
            self.qkv_w = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])  # [3 H hd, D]
            self.gate_up_w = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])  # [2 I, D]
            self.down_wt = mlp.down_proj.weight.t().contiguous()  # [I, D]: mm beats linear at these shapes
        self.o_w = attn.o_proj.weight.detach()
        self.proj_w = head.proj.weight.detach()
        self.lm_w = head.lm_head.weight.detach()
        self.norms = {name: (m.weight.detach(), m.variance_epsilon) for name, m in (
            ("g", head.feature_norm), ("e", head.embed_norm), ("in", layer.input_layernorm),
            ("post", layer.post_attention_layernorm), ("out", head.norm))}
        self._fast_norm = all(w.dtype == torch.float32 for w, _ in self.norms.values()) and dtype == torch.float32
        self.embed_w = self.embed.weight.detach()
        self.d2t = head.draft_to_target
        self._cos = self._sin = None
        if self._k is not None and (self._k.dtype != dtype or self._k.device != device):
            self._k, self._v = self._k.to(device, dtype), self._v.to(device, dtype)
        self._key = self._state_key()

    def reserve(self, columns: int) -> None:
        """Make room for `columns` columns in every row, keeping everything written so far."""
        if self._k is not None and self._k.shape[2] >= columns:
            return
        old = self._k.shape[2] if self._k is not None else 0
        capacity = max(columns, 2 * old, 256)
        k = torch.zeros(self.batch, self.num_heads, capacity, self.head_dim, dtype=self.dtype, device=self.device)
        v = torch.zeros_like(k)
        if old:
            k[:, :, :old] = self._k
            v[:, :, :old] = self._v
        self._k, self._v = k, v

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

    # -- math (mirrors EagleHead.forward / LlamaDecoderLayer) ---------------------------------

    def _norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """LlamaRMSNorm; in float32 `F.rms_norm` is the same arithmetic in one op."""
        weight, eps = self.norms[name]
        if self._fast_norm and x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), weight, eps)
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x.to(dtype)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """[M, D] -> [M, V_draft], as `EagleHead.logits`."""
        return F.linear(self._norm("out", h), self.lm_w)

    def _input(self, g: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """g [N, D], target ids [N] -> x [N, D], the decoder layer's input (and residual stream)."""
        embeds = self.embed_w.index_select(0, token_ids)
        both = torch.cat([self._norm("g", g.to(self.dtype)), self._norm("e", embeds.to(self.dtype))], dim=-1)
        return F.linear(both, self.proj_w)

    # Matmuls run on [B*M, D] rows (a 3-D linear costs more at these sizes); attention on [B, H, M, hd].

    def _qkv(self, x: torch.Tensor, b: int, cos: torch.Tensor, sin: torch.Tensor):
        """x [B*M, D]; cos/sin [hd] (one position for all), [M, hd] (per column, shared by the rows)
        or [B, M, hd] -> q, k, v [B, H, M, hd], rotary applied to q and k."""
        n, h, hd = x.shape[0], self.num_heads, self.head_dim
        m = n // b
        qkv = F.linear(self._norm("in", x), self.qkv_w)  # [B*M, 3 H hd]
        qk = qkv[:, : 2 * h * hd].view(b, m, 2 * h, 2, hd // 2)
        swapped = qk.flip(-2).view(b, m, 2 * h, hd)  # rotate_half up to the sign, which `sin` carries
        if cos.dim() > 1:  # broadcast over the heads
            cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        qk = (qk.view(b, m, 2 * h, hd) * cos + swapped * sin).transpose(1, 2)  # [B, 2H, M, hd]
        return qk[:, :h], qk[:, h:], qkv[:, 2 * h * hd:].view(b, m, h, hd).transpose(1, 2)

    def _finish(self, x: torch.Tensor, q: torch.Tensor, columns: int, mask: torch.Tensor | None) -> torch.Tensor:
        """x [B*M, D], q [B, H, M, hd] over the first `columns` buffered keys (additive mask
        [B, 1, M, columns], None: all visible), then o_proj, MLP, residuals -> h [B*M, D]."""
        out = F.scaled_dot_product_attention(
            q, self._k[:, :, :columns], self._v[:, :, :columns], attn_mask=mask, scale=self.scaling)  # [B, H, M, hd]
        x = x + F.linear(out.transpose(1, 2).reshape(x.shape[0], -1), self.o_w)
        gate, up = F.linear(self._norm("post", x), self.gate_up_w).split(self.intermediate, dim=-1)
        return x + torch.mm(self.act(gate) * up, self.down_wt)

    # -- the two kinds of forward ---------------------------------------------------------------

    def write(self, g: list[torch.Tensor], token_ids: list[torch.Tensor]) -> None:
        """Append each row's pairs (g[b] [A_b, D], target ids [A_b], A_b >= 0) whose h nobody reads:
        only their keys and values, which in a one-layer head depend on each pair's own input alone
        (no attention, no MLP). A prompt's pairs, written when decoding begins; `lengths` advance by A_b."""
        counts = [t.numel() for t in token_ids]
        if not sum(counts):
            return
        starts = self.lengths
        self.lengths = [s + c for s, c in zip(starts, counts)]
        self.reserve(max(self.lengths))
        cos, sin = self._rotary(max(self.lengths))
        rows = torch.cat([torch.full((c,), b, device=self.device) for b, c in enumerate(counts)])  # [A] each pair's row
        columns = torch.cat([torch.arange(s, s + c, device=self.device) for s, c in zip(starts, counts)])  # [A]
        x = self._input(torch.cat(g), torch.cat(token_ids).to(self.device))  # [A, D], every row's pairs in one run
        _, k, v = self._qkv(x, 1, cos[columns], sin[columns])  # [1, H, A, hd]
        self._k[rows, :, columns] = k[0].transpose(0, 1)  # [A, H, hd]
        self._v[rows, :, columns] = v[0].transpose(0, 1)
        self.rows_extended += sum(counts)

    def extend(self, g: list[torch.Tensor], token_ids: list[torch.Tensor]) -> torch.Tensor:
        """Append each row's pairs (g[b] [A_b, D], target ids [A_b], A_b >= 1) causally after its
        committed columns. Returns h [B, D] of each row's last pair; `lengths` advance by A_b."""
        counts = [t.numel() for t in token_ids]
        if min(counts) < 1:
            raise ValueError(f"HeadRunner.extend: every row needs a pair whose h it returns, got counts {counts} "
                             "(pairs nobody reads go in by `write`)")
        b, a = len(counts), max(counts)
        starts = self.lengths
        self.lengths = [s + c for s, c in zip(starts, counts)]
        end, written = max(self.lengths), max(starts) + a  # a shorter row's padding lands past its end
        self.reserve(written)
        cos, sin = self._rotary(written)
        if len(set(starts)) == 1 and len(set(counts)) == 1:  # one column range for every row
            start = starts[0]
            x = self._input(torch.cat(g), torch.cat(token_ids))  # [B*A, D]
            q, k, v = self._qkv(x, b, cos[start:end], sin[start:end])  # [B, H, A, hd]
            self._k[:, :, start:end] = k
            self._v[:, :, start:end] = v
            x_last, q_last, mask = x.view(b, a, -1)[:, -1], q[:, :, -1:], None
        else:
            x = self._input(nn.utils.rnn.pad_sequence(g, batch_first=True).flatten(0, 1),
                            nn.utils.rnn.pad_sequence(token_ids, batch_first=True).flatten())  # [B*A, D]
            columns = torch.tensor(starts, device=self.device)[:, None] + torch.arange(a, device=self.device)  # [B, A]
            q, k, v = self._qkv(x, b, cos[columns], sin[columns])  # [B, H, A, hd]
            rows = torch.arange(b, device=self.device)
            # advanced indices around a slice put their dims first: the target view is [B, A, H, hd]
            self._k[rows[:, None], :, columns] = k.transpose(1, 2)
            self._v[rows[:, None], :, columns] = v.transpose(1, 2)
            last = torch.tensor(counts, device=self.device) - 1  # [B] each row's last pair
            x_last, q_last = x.index_select(0, rows * a + last), q[rows, :, last][:, :, None]
            mask = self._closed_beyond(self.lengths, end)[:, None, None]  # [B, 1, 1, end]
        self.rows_extended += sum(counts)
        return self._finish(x_last, q_last, end, mask)  # x_last [B, D], q_last [B, H, 1, hd]

    def draft(self, g: torch.Tensor, token_ids: torch.Tensor, positions: list[int], mask: torch.Tensor) -> torch.Tensor:
        """M tree rows per batch row (g [B, M, D], target ids [B, M]), row b's at positions[b],
        written to the last M of the C columns that mask [B, M, C] (additive: 0 or dtype-min)
        covers: each row's prefix and the tree drafted so far. Returns h [B, M, D]."""
        b, m = token_ids.shape
        columns = mask.shape[2]
        self.reserve(columns)
        cos, sin = self._rotary(max(positions) + 1)
        if len(set(positions)) == 1:
            cos, sin = cos[positions[0]], sin[positions[0]]  # [hd] for every row
        else:
            at = torch.tensor(positions, device=self.device)
            cos, sin = cos[at][:, None], sin[at][:, None]  # [B, 1, hd]
        x = self._input(g.reshape(b * m, -1), token_ids.reshape(-1))  # [B*M, D]
        q, k, v = self._qkv(x, b, cos, sin)  # [B, H, M, hd]
        self._k[:, :, columns - m: columns] = k
        self._v[:, :, columns - m: columns] = v
        self.rows_drafted += b * m
        return self._finish(x, q, columns, mask[:, None]).view(b, m, -1)
