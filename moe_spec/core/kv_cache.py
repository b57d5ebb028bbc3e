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


def keep_positions(cache: DynamicCache, keep: torch.Tensor) -> None:
    """Keep only cache positions `keep` ([P'] long, increasing), in every layer, in place."""
    length = cache_length(cache)
    if keep.numel() == length and bool((keep == torch.arange(length)).all()):
        return
    contiguous_prefix = bool((keep == torch.arange(keep.numel())).all())
    if contiguous_prefix:
        cache.crop(keep.numel() - length)  # negative count: drop that many trailing positions
        return
    for layer in cache.layers:
        if not layer.is_initialized or layer.keys.numel() == 0:
            continue
        index = keep.to(layer.keys.device)
        layer.keys = layer.keys.index_select(-2, index)
        layer.values = layer.values.index_select(-2, index)


def keep_accepted_path(cache: DynamicCache, prefix_len: int, path: list[int]) -> None:
    """After a tree pass over `prefix_len` cached positions, keep the prefix plus `path`'s nodes."""
    keep = torch.cat([torch.arange(prefix_len), prefix_len + torch.tensor(path, dtype=torch.long)])
    keep_positions(cache, keep)


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
