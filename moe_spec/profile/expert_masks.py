"""Expert sets as bit masks: bit x of a node's mask is set when it loads flat id x = layer * E + expert.

Controllers price 0/1 routing in plain Python on every step's critical path (`policy.row_growth`):
a mask's union, difference and count are single integer operations, where a set's cost grows with
its L * K members. The predictors build masks straight from numpy (`masks_of_bits`).
"""

from __future__ import annotations

import numpy as np


def masks_of_bits(bits: np.ndarray) -> list[int]:
    """[N, W] bool -> each row's mask (column x: bit x)."""
    packed = np.packbits(bits, axis=1, bitorder="little")  # [N, ceil(W / 8)] uint8: bit x of a row in byte x // 8
    raw, step = packed.tobytes(), packed.shape[1]
    return [int.from_bytes(raw[start:start + step], "little") for start in range(0, len(raw), step)]


def masks_of_ids(ids: np.ndarray, width: int) -> list[int]:
    """[N, M] flat ids per node (each < width) -> each node's mask."""
    bits = np.zeros((len(ids), width), dtype=bool)  # [N, width]
    np.put_along_axis(bits, np.asarray(ids), True, axis=1)
    return masks_of_bits(bits)


def ids_of_mask(mask: int) -> frozenset[int]:
    """A mask's flat ids."""
    return frozenset(x for x in range(mask.bit_length()) if mask >> x & 1)
