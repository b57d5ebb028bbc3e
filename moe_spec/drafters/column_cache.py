"""`ColumnCache`: what a drafter running transformers' own decoder layers hands them as
`past_key_values`, so that each row's keys and values land at the columns the drafter chooses
(a row's committed columns, a tree's shared columns) instead of being appended; attention then
reads every column up to a width, under the drafter's additive mask. `update` is the only method
transformers' attention modules call on a cache when they are given an explicit 4D mask.
"""

from __future__ import annotations

import torch


class ColumnCache:
    """Keys and values of a drafter's own layers in per-layer [B, H, capacity, dim] buffers. Before each
    forward the runner says where the new entries go (`at`: per-row columns, or one shared slice)
    and how many columns attention reads (`width`); `update` is the only method transformers'
    attention calls."""

    def __init__(self, layers: int):
        self.keys: list[torch.Tensor | None] = [None] * layers
        self.values: list[torch.Tensor | None] = [None] * layers
        self.rows = self.columns = None  # [B, 1], [B, N] long; or None with `span`
        self.span: tuple[int, int] | None = None  # shared columns [start, end) of every row
        self.width = 0

    def at(self, width: int, columns: torch.Tensor | None = None, span: tuple[int, int] | None = None) -> None:
        self.width, self.columns, self.span = width, columns, span
        self.rows = None if columns is None else torch.arange(columns.shape[0], device=columns.device)[:, None]

    def clear(self) -> None:
        self.keys = [None] * len(self.keys)
        self.values = [None] * len(self.values)

    def keep_rows(self, rows: list[int]) -> None:
        for buffers in (self.keys, self.values):
            for i, buffer in enumerate(buffers):
                if buffer is not None:
                    buffers[i] = buffer[torch.tensor(rows, device=buffer.device)]

    def _room(self, buffers: list, layer: int, new: torch.Tensor) -> torch.Tensor:
        """Layer `layer`'s buffer shaped like `new` [B, H, *, dim] with at least `width` columns."""
        buffer = buffers[layer]
        if buffer is None or buffer.shape[2] < self.width or buffer.shape[0] != new.shape[0]:
            old = 0 if buffer is None or buffer.shape[0] != new.shape[0] else buffer.shape[2]
            grown = new.new_zeros(new.shape[0], new.shape[1], max(self.width, 2 * old, 256), new.shape[3])
            if old:
                grown[:, :, :old] = buffer
            buffers[layer] = buffer = grown
        return buffer

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key [B, H, N, dk], value [B, H, N, dv] -> every written column up to `width` of both."""
        out = []
        for buffers, new in ((self.keys, key), (self.values, value)):
            buffer = self._room(buffers, layer_idx, new)
            if self.span is not None:
                buffer[:, :, self.span[0]: self.span[1]] = new
            else:  # advanced indices around a slice put their dims first: the target view is [B, N, H, dim]
                buffer[self.rows, :, self.columns] = new.transpose(1, 2)
            out.append(buffer[:, :, : self.width])
        return out[0], out[1]


def additive(open_: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool -> additive mask of the same shape: 0 where open, dtype-min elsewhere."""
    return torch.zeros(open_.shape, dtype=dtype, device=open_.device).masked_fill_(~open_, torch.finfo(dtype).min)


def prefix_mask(visible: list[int], dtype: torch.dtype, device) -> torch.Tensor:
    """[B, P] additive mask over the columns before a tree (P = max(visible)): row b sees its first visible[b]."""
    open_ = torch.arange(max(visible), device=device)[None] < torch.tensor(visible, device=device)[:, None]
    return additive(open_, dtype)
