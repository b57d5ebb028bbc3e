"""`MtpRunner`: a checkpoint's MTP layers (transformers' `MtpModel`) run as a tree drafter's head.

The layers are transformers' own modules, called as `MtpLayer(inputs_embeds, previous_hidden_state,
position_embeddings, attention_mask, position_ids, past_key_values)`, as `MtpModel.forward_layer`
calls them, with moe_spec's additive tree mask and a cache of its own (`ColumnCache`: the one
method attention calls, `update`, writing each row's keys at the columns the runner chose). What
transformers' `MtpModel.forward` computes for a chain, this computes for a tree:

- Column j of MTP layer k holds the pair at position j + 1: for layer 0, (token x_{j+1}, the
  target's last hidden state at position j, after its final norm, as transformers feeds it); for
  layer k >= 1, (x_{j+1}, layer k - 1's output at column j - 1): transformers rolls each layer's
  inputs by one token, so layer k's first k columns hold nothing and are masked.
- Committed pairs (`write`, `extend`) run through every layer, each layer's outputs kept per
  column (`_outputs`) for the next layer's inputs; `extend` returns layer 0's output at each row's
  last pair (the root pair), whose logits are the root's children.
- A tree node at depth d >= 1 runs through layer d mod L (L layers; deeper than L reuses them, as
  vLLM does) on (its token, its parent's output) and attends to that layer's committed columns and
  to its ancestors drafted by the same layer (`draft`).

`logits` is `MtpModel._project_to_logits` (the target's output layer on the layer's post-normed
output); the draft vocabulary is the target's (`d2t` the identity).
"""

from __future__ import annotations

import torch
from torch import nn

from moe_spec.drafters.column_cache import ColumnCache, additive, prefix_mask


class MtpRunner:
    """The runner interface `TreeDrafter` drafts with (see `HeadRunner`), over an `MtpModel`."""

    def __init__(self, mtp, batch: int = 1):
        self.mtp = mtp
        self.num_layers = len(mtp.layers)
        self.lengths = [0] * batch  # committed pair columns per row
        self.rows_extended = 0
        self.rows_drafted = 0
        self._cache = ColumnCache(self.num_layers)
        self._outputs: list[torch.Tensor | None] = [None] * self.num_layers  # per layer [B, capacity, D]
        self._tree: list[tuple[int, int, int]] = []  # this proposal's drafted column ranges: (start, end, layer)
        self.refresh()

    # -- state ------------------------------------------------------------------------------

    @property
    def batch(self) -> int:
        return len(self.lengths)

    def refresh(self) -> None:
        weight = self.mtp.embed_tokens.weight
        self.dtype, self.device = self.mtp.layers[0].eh_proj.weight.dtype, weight.device
        self.draft_vocab = int(getattr(self.mtp.config, "unpadded_vocab_size", None) or self.mtp.config.vocab_size)
        if getattr(self, "d2t", None) is None or self.d2t.numel() != self.draft_vocab or self.d2t.device != self.device:
            self.d2t = torch.arange(self.draft_vocab, device=self.device)

    def reset(self, batch: int) -> None:
        self.lengths = [0] * batch
        self._cache.clear()
        self._outputs = [None] * self.num_layers
        self._tree = []

    def keep_rows(self, rows: list[int]) -> None:
        self.lengths = [self.lengths[i] for i in rows]
        self._cache.keep_rows(rows)
        index = torch.tensor(rows, device=self.device)
        self._outputs = [o[index] if o is not None else None for o in self._outputs]

    def _closed(self, open_: torch.Tensor) -> torch.Tensor:
        return additive(open_, self.dtype)

    def prefix_mask(self, visible: list[int]) -> torch.Tensor:
        """[B, P] additive mask over the pair columns before a tree (P = max(visible))."""
        return prefix_mask(visible, self.dtype, self.device)

    # -- math ---------------------------------------------------------------------------------

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """[M, D] -> [M, V], as `MtpModel._project_to_logits`."""
        return self.mtp._project_to_logits(h)

    def _layer(self, k: int, token_ids: torch.Tensor, previous: torch.Tensor, positions: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
        """MTP layer k on tokens [B, N] with previous states [B, N, D] at positions [B, N] under an
        additive mask [B, 1, N, width] -> its outputs [B, N, D] (after the shared post-norm, if any)."""
        mtp = self.mtp
        embeds = mtp.embed_tokens(token_ids).to(self.dtype)
        position_embeddings = None
        if mtp.rotary_emb is not None:
            kwargs = {"layer_type": mtp.config.layer_types[k]} if mtp.has_per_layer_rope else {}
            position_embeddings = mtp.rotary_emb(embeds, position_ids=positions, **kwargs)
        out = mtp.layers[k](embeds, previous.to(self.dtype), position_embeddings=position_embeddings,
                            attention_mask=mask, position_ids=positions, past_key_values=self._cache)
        if mtp.use_shared_post_norm:
            out = mtp.shared_post_norm(out)
        return out

    def _reserve_outputs(self, columns: int, hidden: int) -> None:
        for k, out in enumerate(self._outputs):
            if out is None or out.shape[1] < columns or out.shape[0] != self.batch:
                old = 0 if out is None or out.shape[0] != self.batch else out.shape[1]
                grown = torch.zeros(self.batch, max(columns, 2 * old, 256), hidden, dtype=self.dtype, device=self.device)
                if old:
                    grown[:, :old] = out
                self._outputs[k] = grown

    # -- the three kinds of forward -------------------------------------------------------------

    def write(self, g: list[torch.Tensor], token_ids: list[torch.Tensor]) -> None:
        """Append each row's pairs (g[b] [A_b, D] target states, target ids [A_b], A_b >= 0)."""
        if sum(t.numel() for t in token_ids):
            self._run(g, token_ids)

    def extend(self, g: list[torch.Tensor], token_ids: list[torch.Tensor]) -> torch.Tensor:
        """Append each row's pairs (A_b >= 1) causally; returns layer 0's output [B, D] at each row's last."""
        counts = [t.numel() for t in token_ids]
        if min(counts) < 1:
            raise ValueError(f"MtpRunner.extend: every row needs a pair whose output it returns, got counts {counts}")
        self._tree = []
        return self._run(g, token_ids)

    @torch.no_grad()
    def _run(self, g: list[torch.Tensor], token_ids: list[torch.Tensor]) -> torch.Tensor:
        """Each row's pairs at its own columns lengths[b]..., through every layer (each causal over
        its own valid columns); returns layer 0's output [B, D] at each row's last pair."""
        counts = [t.numel() for t in token_ids]
        b, a = len(counts), max(counts)
        starts = torch.tensor(self.lengths, device=self.device)
        self.lengths = [s + c for s, c in zip(self.lengths, counts)]
        written = int(starts.max()) + a  # a shorter row's padding lands past its end
        columns = starts[:, None] + torch.arange(a, device=self.device)  # [B, A]
        rows = torch.arange(b, device=self.device)[:, None]
        previous = nn.utils.rnn.pad_sequence([x.to(self.device, self.dtype) for x in g], batch_first=True)  # [B, A, D]
        tokens = nn.utils.rnn.pad_sequence([t.to(self.device) for t in token_ids], batch_first=True)  # [B, A]
        self._reserve_outputs(written, previous.shape[-1])
        keys = torch.arange(written, device=self.device)
        for k in range(self.num_layers):
            if k > 0:  # layer k reads layer k - 1's output one column to the left
                previous = self._outputs[k - 1][rows, (columns - 1).clamp(min=0)]  # [B, A, D]
            open_ = (keys[None, None] <= columns[..., None]) & (keys >= k)[None, None]  # [B, A, written]
            self._cache.at(written, columns=columns)
            out = self._layer(k, tokens, previous, columns + 1, self._closed(open_)[:, None])
            self._outputs[k][rows, columns] = out
        self.rows_extended += sum(counts)
        last = torch.tensor(counts, device=self.device) - 1
        return self._outputs[0][rows[:, 0], columns[rows[:, 0], last]]

    @torch.no_grad()
    def draft(self, h: torch.Tensor, token_ids: torch.Tensor, positions: list[int], mask: torch.Tensor,
              depth: int = 1) -> torch.Tensor:
        """M tree nodes per row at depth `depth` (h [B, M, D] their parents' outputs, target ids
        [B, M]), row b's at positions[b], written to the last M of the C columns that mask [B, M, C]
        covers (each row's prefix and the tree so far). Returns their outputs [B, M, D]."""
        b, m = token_ids.shape
        columns = mask.shape[2]
        layer = depth % self.num_layers
        if self.num_layers > 1:  # only this layer's prefix columns and this layer's drafted ancestors hold its keys
            open_ = torch.arange(columns, device=self.device) >= layer
            for start, end, other in self._tree:
                if other != layer:
                    open_[start:end] = False
            mask = mask.masked_fill(~open_, torch.finfo(self.dtype).min)
        self._tree.append((columns - m, columns, layer))
        at = (torch.tensor(positions, device=self.device) + 1)[:, None].expand(b, m)  # [B, M]
        self._cache.at(columns, span=(columns - m, columns))
        out = self._layer(layer, token_ids, h, at, mask[:, None].to(self.dtype))
        self.rows_drafted += b * m
        return out
