"""The shapes of a batched verify pass, as pure functions.

Every row's committed tokens sit right-aligned in the shared cache: row b's S_b tokens fill the
last S_b of the P cached columns, and `valid [B, P]` marks them. A step appends each row's tree
(padded to the widest tree with copies of the row's root, see `step_inputs`) and then keeps, per row, its
committed columns plus its accepted path: the path moves to the start of the tree's columns and the
cache is cropped to the longest path (`tail_layout`), so a row with a shorter path leaves invalid
columns behind, as left padding is; once those are worth it the cache is repacked, every row's
valid columns right-aligned again (`repack`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moe_spec.core.forest import StepForest
from moe_spec.core.tree import DraftTree, ancestor_mask


def prefill_inputs(prompts: list[torch.Tensor], pad_token: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded prompts as one causal pass: input_ids [B, T], tree_mask [B, T, T], position_ids [B, T],
    valid [B, T] (the columns holding real tokens)."""
    width = max(p.numel() for p in prompts)
    batch = len(prompts)
    input_ids = torch.full((batch, width), pad_token, dtype=torch.long)
    valid = torch.zeros(batch, width, dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - prompt.numel():] = prompt
        valid[row, width - prompt.numel():] = True
    causal = torch.tril(torch.ones(width, width, dtype=torch.bool))
    tree_mask = (causal[None] & valid[:, None, :]) | torch.eye(width, dtype=torch.bool)[None]  # pads see themselves
    position_ids = (valid.long().cumsum(1) - 1).clamp(min=0)
    return input_ids, tree_mask, position_ids, valid


def step_inputs(forest: StepForest | Sequence[DraftTree], lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows' trees padded to the forest's width N: input_ids [B, N], tree_mask [B, N, N], position_ids [B, N].

    lengths: [B] long, each row's committed tokens (its next position). A padding slot is a copy of
    its row's root: same token, same position, seeing the row's prefix and itself. Its hidden states
    are then the root's, so it routes to the root's experts and a batch's padding loads no expert
    the rows do not load anyway (it still costs its token's compute). Nothing reads its outputs and
    no node sees it; compaction drops its cache column.
    """
    forest = StepForest.of(forest)
    trees, width, batch = forest.trees, forest.width, forest.rows
    if width == 1:  # roots alone (plain decoding): one token per row at its next position
        return torch.cat([t.tokens for t in trees])[:, None], torch.ones(batch, 1, 1, dtype=torch.bool), lengths[:, None].clone()
    input_ids = torch.stack([t.tokens[:1] for t in trees]).repeat(1, width)  # [B, N]: every slot the root
    tree_mask = torch.eye(width, dtype=torch.bool).repeat(batch, 1, 1)
    position_ids = lengths[:, None].repeat(1, width).clone()
    for row, tree in enumerate(trees):
        n = len(tree)
        input_ids[row, :n] = tree.tokens
        tree_mask[row, :n, :n] = ancestor_mask(tree)
        position_ids[row, :n] = lengths[row] + tree.depths
    return input_ids, tree_mask, position_ids


def tail_layout(valid: torch.Tensor, paths: list[list[int]]) -> torch.Tensor:
    """The valid columns [B, P + longest path] after `kv_cache.keep_tree_paths` moved each row's
    accepted path to the start of the tree's columns: the committed columns as before, then row b's
    first len(paths[b]) tail columns (the rest of its tail holds stale columns)."""
    longest = max(len(path) for path in paths)
    tail = torch.arange(longest)[None, :] < torch.tensor([len(path) for path in paths])[:, None]  # [B, longest]
    return torch.cat([valid, tail], dim=1)


def removable_columns(valid: torch.Tensor) -> int:
    """Columns a `repack` would drop: the cache's width less its longest row's valid columns."""
    return valid.shape[1] - int(valid.sum(1).max())


def worth_repacking(valid: torch.Tensor) -> bool:
    """Whether the stale columns batched steps leave behind (`tail_layout`) cost more attention than
    a `repack` costs: a repack copies the whole cache, stale columns cost every later pass their
    share of attention, so the cache is repacked once they exceed 1/16 of its width (at least 16)."""
    return removable_columns(valid) > max(16, valid.shape[1] // 16)


def repack(valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row's valid columns of `valid` [B, P], in order and right-aligned in a cache of the longest
    row's width P': (index [B, P'] of the columns each row keeps, left filler pointing at column 0,
    for `kv_cache.gather_columns`; the new valid [B, P'])."""
    counts = valid.sum(1)  # [B]
    width = int(counts.max())
    index = torch.zeros(valid.shape[0], width, dtype=torch.long)
    new_valid = torch.arange(width)[None, :] >= (width - counts)[:, None]  # [B, P']
    for row in range(valid.shape[0]):
        columns = valid[row].nonzero().flatten()
        index[row, width - columns.numel():] = columns
    return index, new_valid
