"""`BatchHeadRunner`: the draft head's inference forward for B independent rows at once.

The same math as `HeadRunner` (and so as `EagleHead.forward`), with a batch dimension: keys and
values live in `[B, H, capacity, head_dim]` buffers, row b's first `lengths[b]` columns being its
committed pairs. Rows differ in length, so every forward carries an additive mask per row:

- `append` writes each row's committed pairs at that row's own columns `lengths[b]...` (a row
  with fewer pairs leaves scratch after its end, which nothing reads); `extend` does the same for
  one pair per row (the root pairs) and returns their h;
- `draft` writes all rows' tree nodes at one shared column range starting at `tree_start` (past
  every row's prefix); row b sees its prefix columns `< visible[b]` and the tree columns its
  tree mask opens, so the gap between its prefix and `tree_start` stays hidden.

Drafting B rows this way costs one forward per tree depth for the whole batch, instead of one
per row: at a draft head's sizes the per-call overhead, not arithmetic, dominates.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from moe_spec.drafters.eagle_head import EagleHead, HeadRunner


class BatchHeadRunner(HeadRunner):
    def __init__(self, head: EagleHead, embed: nn.Module, batch: int):
        super().__init__(head, embed)
        self.lengths = torch.zeros(batch, dtype=torch.long)  # [B] committed columns per row

    @property
    def batch(self) -> int:
        return self.lengths.numel()

    def reset(self, batch: int | None = None) -> None:
        self.lengths = torch.zeros(self.batch if batch is None else batch, dtype=torch.long)
        if self._k is not None and self._k.shape[0] != self.batch:
            self._k = self._v = None

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only these rows (indices into the current batch), in this order."""
        self.lengths = self.lengths[rows]
        if self._k is not None:
            index = rows.to(self._k.device)
            self._k, self._v = self._k[index], self._v[index]

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

    def _closed_beyond(self, visible: torch.Tensor, columns: int) -> torch.Tensor:
        """[B, columns] additive mask: 0 for columns < visible[b], dtype-min after."""
        open_ = torch.arange(columns, device=self.device)[None] < visible.to(self.device)[:, None]
        return torch.zeros(open_.shape, dtype=self.dtype, device=self.device).masked_fill_(~open_, torch.finfo(self.dtype).min)

    def _finish_rows(self, x: torch.Tensor, q: torch.Tensor, columns: int, mask: torch.Tensor) -> torch.Tensor:
        """x [B, M, D], q [B, H, M, hd], mask [B, 1, M, columns] -> h [B, M, D]."""
        b, m, d = x.shape
        out = F.scaled_dot_product_attention(
            q, self._k[:, :, :columns], self._v[:, :, :columns], attn_mask=mask, scale=self.scaling)  # [B, H, M, hd]
        x = x.reshape(b * m, d) + F.linear(out.transpose(1, 2).reshape(b * m, -1), self.o_w)
        gate, up = F.linear(self._norm("post", x), self.gate_up_w).split(self.intermediate, dim=-1)
        return (x + torch.mm(self.act(gate) * up, self.down_wt)).view(b, m, d)

    def _write(self, k: torch.Tensor, v: torch.Tensor, columns: torch.Tensor) -> None:
        """k, v [H, B*A, hd] of A pairs per row -> buffer columns `columns` [B, A] of each row."""
        b, a = columns.shape
        rows = torch.arange(b, device=self.device)[:, None].expand(b, a)
        index = columns.to(self.device)
        # advanced indices around a slice put their dims first: the target view is [B, A, H, hd]
        self._k[rows, :, index] = k.view(self.num_heads, b, a, self.head_dim).permute(1, 2, 0, 3)
        self._v[rows, :, index] = v.view(self.num_heads, b, a, self.head_dim).permute(1, 2, 0, 3)

    def append(self, g: list[torch.Tensor], token_ids: list[torch.Tensor]) -> None:
        """Commit each row's pairs (g[b] [A_b, D], target ids [A_b], A_b >= 0) after its committed
        columns. Only their keys and values are computed: a committed pair's h is never read (the
        pair after it reads the target's features), so attention and MLP are skipped."""
        counts = torch.tensor([t.numel() for t in token_ids])  # [B]
        b, a = len(token_ids), int(counts.max())
        if a == 0:
            return
        pairs_g = nn.utils.rnn.pad_sequence(g, batch_first=True)  # [B, A, D]
        pairs_ids = nn.utils.rnn.pad_sequence(token_ids, batch_first=True)  # [B, A]
        columns = self.lengths[:, None] + torch.arange(a)  # [B, A]; padding lands past each row's end
        self.reserve(int(columns.max()) + 1)
        cos, sin = self._rotary(int(columns.max()) + 1)
        flat = columns.flatten().to(self.device)
        x = self._input(pairs_g.reshape(b * a, -1), pairs_ids.reshape(-1))  # [B*A, D]
        _, k, v = self._qkv(x, cos[flat], sin[flat])  # [H, B*A, hd]
        self._write(k, v, columns)
        self.lengths = self.lengths + counts
        self.rows_extended += int(counts.sum())

    def extend(self, g: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """One pair per row (g [B, D], target ids [B]) after its committed columns; returns h [B, D].
        `lengths` advance by one."""
        b = token_ids.shape[0]
        columns = self.lengths[:, None]  # [B, 1]
        end = int(self.lengths.max()) + 1
        self.reserve(end)
        cos, sin = self._rotary(end)
        at = columns.flatten().to(self.device)
        x = self._input(g, token_ids)  # [B, D]
        q, k, v = self._qkv(x, cos[at], sin[at])  # [H, B, hd]
        self._write(k, v, columns)
        self.lengths = self.lengths + 1
        self.rows_extended += b
        mask = self._closed_beyond(self.lengths, end)[:, None, None]  # [B, 1, 1, end]
        return self._finish_rows(x[:, None], q.transpose(0, 1)[:, :, None], end, mask)[:, 0]

    def draft(self, g: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor, tree_start: int,
              visible: torch.Tensor, tree_mask: torch.Tensor) -> torch.Tensor:
        """M tree rows per batch row (g [B, M, D], target ids [B, M]) at row positions [B].

        tree_mask: [B, M, T] additive over the shared tree columns tree_start..tree_start+T-1, the
        last M of which these rows are written to; row b also sees its prefix columns < visible[b].
        Returns h [B, M, D].
        """
        b, m = token_ids.shape
        columns = tree_start + tree_mask.shape[2]
        self.reserve(columns)
        cos, sin = self._rotary(int(positions.max()) + 1)
        at = positions.to(self.device).repeat_interleave(m)  # [B*M]
        x = self._input(g.reshape(b * m, -1), token_ids.reshape(-1))  # [B*M, D]
        q, k, v = self._qkv(x, cos[at], sin[at])  # [H, B*M, hd]
        self._k[:, :, columns - m: columns] = k.view(self.num_heads, b, m, self.head_dim).transpose(0, 1)
        self._v[:, :, columns - m: columns] = v.view(self.num_heads, b, m, self.head_dim).transpose(0, 1)
        prefix = self._closed_beyond(visible, tree_start)[:, None].expand(b, m, tree_start)  # [B, M, tree_start]
        mask = torch.cat([prefix, tree_mask.to(self.dtype)], dim=2)[:, None]  # [B, 1, M, columns]
        q = q.view(self.num_heads, b, m, self.head_dim).transpose(0, 1)  # [B, H, M, hd]
        self.rows_drafted += b * m
        return self._finish_rows(x.view(b, m, -1), q, columns, mask)
