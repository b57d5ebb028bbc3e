"""`DraftModelRunner`: a small causal LM run as a tree drafter's head (`DraftModelDrafter`).

transformers' own modules of the draft model (its embedding, rotary table, decoder layers, final
norm and output layer) are called one forward per tree depth with moe_spec's additive tree mask,
over a `ColumnCache` of the draft model's own keys and values: a row's committed tokens at its own
columns, a tree's nodes at shared columns past every row's, dropped after each proposal by not
advancing `lengths` (the draft model's cache is "cropped back" to the committed tokens).

Columns. A tree drafter speaks in pairs (column j: the target's state at position j, token
x_{j+1}); a draft model reads tokens alone and also needs each row's first token, so cache column 0
holds x_0 (`start`) and pair column j is cache column j + 1, at position j + 1. The pairs' target
states are not read. A sliding window in the draft model's config is not applied (drafts only get
worse past it; verification is unaffected).
"""

from __future__ import annotations

import torch
from torch import nn

from moe_spec.drafters.column_cache import ColumnCache, additive, prefix_mask


class DraftModelRunner:
    """The runner interface `TreeDrafter` drafts with (see `HeadRunner`), over a causal LM."""

    def __init__(self, model, batch: int = 1):
        self.model = model
        self.decoder = model.get_decoder()
        self.layers = list(self.decoder.layers)
        self.lengths = [0] * batch  # committed pair columns per row (cache columns: one more, x_0 first)
        self.rows_extended = 0
        self.rows_drafted = 0
        self._cache = ColumnCache(len(self.layers))
        self.refresh()

    @property
    def batch(self) -> int:
        return len(self.lengths)

    def refresh(self) -> None:
        weight = self.model.get_output_embeddings().weight
        self.dtype, self.device = weight.dtype, weight.device
        self.draft_vocab = int(weight.shape[0])
        if getattr(self, "d2t", None) is None or self.d2t.numel() != self.draft_vocab or self.d2t.device != self.device:
            self.d2t = torch.arange(self.draft_vocab, device=self.device)

    def reset(self, batch: int) -> None:
        self.lengths = [0] * batch
        self._cache.clear()

    def keep_rows(self, rows: list[int]) -> None:
        self.lengths = [self.lengths[i] for i in rows]
        self._cache.keep_rows(rows)

    def _closed(self, open_: torch.Tensor) -> torch.Tensor:
        return additive(open_, self.dtype)

    def prefix_mask(self, visible: list[int]) -> torch.Tensor:
        """[B, P] additive mask over the pair columns before a tree (P = max(visible))."""
        return prefix_mask(visible, self.dtype, self.device)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """[M, D] final (normed) states -> [M, V] the draft model's logits."""
        return self.model.get_output_embeddings()(h)

    def _forward(self, token_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Tokens [B, N] at positions [B, N] under an additive mask [B, 1, N, width] -> final states [B, N, D]."""
        x = self.decoder.embed_tokens(token_ids)
        position_embeddings = self.decoder.rotary_emb(x, position_ids=positions)
        for layer in self.layers:
            x = layer(x, attention_mask=mask, position_ids=positions, past_key_values=self._cache,
                      position_embeddings=position_embeddings)
        return self.decoder.norm(x)

    @torch.no_grad()
    def start(self, first_tokens: list[torch.Tensor]) -> None:
        """Each row's first token ([1] long each) at cache column 0, before any pair."""
        tokens = torch.cat([t.reshape(1) for t in first_tokens]).to(self.device)[:, None]  # [B, 1]
        self._cache.at(1, span=(0, 1))
        self._forward(tokens, torch.zeros_like(tokens), torch.zeros(len(first_tokens), 1, 1, 1, dtype=self.dtype,
                                                                    device=self.device))

    def write(self, g: list[torch.Tensor], token_ids: list[torch.Tensor]) -> None:
        if sum(t.numel() for t in token_ids):
            self._run(token_ids)

    def extend(self, g: list[torch.Tensor], token_ids: list[torch.Tensor]) -> torch.Tensor:
        counts = [t.numel() for t in token_ids]
        if min(counts) < 1:
            raise ValueError(f"DraftModelRunner.extend: every row needs a token whose output it returns, got counts {counts}")
        return self._run(token_ids)

    @torch.no_grad()
    def _run(self, token_ids: list[torch.Tensor]) -> torch.Tensor:
        """Each row's tokens at its own cache columns lengths[b] + 1..., causally; returns the final
        state [B, D] of each row's last token."""
        counts = [t.numel() for t in token_ids]
        b, a = len(counts), max(counts)
        starts = torch.tensor(self.lengths, device=self.device) + 1  # cache columns
        self.lengths = [s + c for s, c in zip(self.lengths, counts)]
        written = int(starts.max()) + a
        columns = starts[:, None] + torch.arange(a, device=self.device)  # [B, A]
        tokens = nn.utils.rnn.pad_sequence([t.to(self.device) for t in token_ids], batch_first=True)  # [B, A]
        open_ = torch.arange(written, device=self.device)[None, None] <= columns[..., None]  # [B, A, written]
        self._cache.at(written, columns=columns)
        out = self._forward(tokens, columns, self._closed(open_)[:, None])  # [B, A, D]
        self.rows_extended += sum(counts)
        last = torch.tensor(counts, device=self.device) - 1
        return out[torch.arange(b, device=self.device), last]

    @torch.no_grad()
    def draft(self, h: torch.Tensor, token_ids: torch.Tensor, positions: list[int], mask: torch.Tensor,
              depth: int = 1) -> torch.Tensor:
        """M tree nodes per row (target ids [B, M]; `h`, their parents' states, is not read: a draft
        model reads its own cache), row b's at pair position positions[b], written to the last M of
        the C pair columns that mask [B, M, C] covers. Returns their final states [B, M, D]."""
        b, m = token_ids.shape
        width = mask.shape[2] + 1  # cache columns: x_0 first
        full = torch.cat([mask.new_zeros(b, m, 1), mask], dim=2).to(self.dtype)  # x_0 is visible to every node
        at = (torch.tensor(positions, device=self.device) + 1)[:, None].expand(b, m)  # [B, M]
        self._cache.at(width, span=(width - m, width))
        out = self._forward(token_ids, at, full[:, None])
        self.rows_drafted += b * m
        return out
