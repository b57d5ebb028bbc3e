"""Keeping exactly the accepted positions of the target's KV cache after a tree pass.

After verifying a tree the cache holds `prefix_len` committed positions followed by one
position per tree node. We keep the prefix and the accepted path's nodes, in path order, so
the cache equals the one token-by-token decoding would have built.

moe_spec creates its caches as a plain `DynamicCache()` (full layers, also for sliding-window
layers such as GPT-OSS's): a window-trimmed layer cannot drop arbitrary tree positions, and
the window is enforced by the attention mask instead (see `target.py`).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


def cache_length(cache: DynamicCache) -> int:
    return cache.get_seq_length()


def keep_tree_paths(cache: DynamicCache, prefix_len: int, paths: list[list[int]]) -> None:
    """After a tree pass over `prefix_len` cached columns: row b's accepted path (tree columns
    `prefix_len + paths[b]`, in path order) moved to columns prefix_len .. prefix_len + len(paths[b]) - 1,
    and the cache cropped to prefix_len plus the longest path, in every layer, in place.

    Only the tree's columns move, never the committed prefix: a full re-gather of a 16-row cache of a
    few hundred columns cost more per step than the rest of the engine's work after the pass. One row
    ends dense, as token-by-token decoding builds it; in a batch, a row whose path is shorter than
    the longest leaves stale columns at its tail, which the caller marks invalid
    (`batch_layout.tail_layout`)."""
    longest = max(len(path) for path in paths)
    if all(path == list(range(len(path))) for path in paths):  # every path already in place
        cache.crop(prefix_len + longest - cache_length(cache))  # a negative count: drop that many trailing columns
        return
    index = torch.tensor([path + path[-1:] * (longest - len(path)) for path in paths], dtype=torch.long)  # [B, longest]
    end = prefix_len + longest
    for layer in cache.layers:
        if not layer.is_initialized or layer.keys.numel() == 0:
            continue
        idx = index.to(layer.keys.device)
        for name in ("keys", "values"):
            states = getattr(layer, name)  # [B, H, P + W, D]
            moved = states[:, :, prefix_len:].gather(2, idx[:, None, :, None].expand(-1, states.shape[1], -1, states.shape[3]))
            states[:, :, prefix_len:end] = moved  # [B, H, longest, D]
            setattr(layer, name, states[:, :, :end])


def gather_columns(cache: DynamicCache, index: torch.Tensor) -> None:
    """Per row, keep cache columns `index` ([B, P'] long) in every layer, in place."""
    for layer in cache.layers:
        if not layer.is_initialized or layer.keys.numel() == 0:
            continue
        idx = index.to(layer.keys.device)
        layer.keys = layer.keys.gather(2, idx[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3]))
        layer.values = layer.values.gather(
            2, idx[:, None, :, None].expand(-1, layer.values.shape[1], -1, layer.values.shape[3])
        )


def select_rows(cache: DynamicCache, rows: torch.Tensor) -> None:
    """Keep only batch rows `rows` ([B'] long) in every layer, in place."""
    for layer in cache.layers:
        if not layer.is_initialized or layer.keys.numel() == 0:
            continue
        idx = rows.to(layer.keys.device)
        layer.keys = layer.keys.index_select(0, idx)
        layer.values = layer.values.index_select(0, idx)
