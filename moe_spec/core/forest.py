"""`StepForest`: the B rows' trees of one verify pass, side by side (B = 1: one sequence).

The one place that knows how a batched pass is laid out: every row is padded to the widest row
(`width`), so the pass computes `pass_tokens = B * width` tokens (`batch_layout.step_inputs` fills
the padding with copies of each row's root, which load no extra expert). Controllers, the engine
and the profiler read the layout from here instead of re-deriving it.

Flattened, the rows' nodes sit one after another: row b's node i is flat node `offsets[b] + i`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate

import numpy as np
import torch

from moe_spec.core.tree import DraftTree, subtrees


@dataclass(frozen=True)
class StepForest:
    trees: tuple[DraftTree, ...]

    def __post_init__(self):
        object.__setattr__(self, "trees", tuple(self.trees))
        if not self.trees:
            raise ValueError("a verify pass has at least one row")

    @staticmethod
    def of(trees: Sequence[DraftTree]) -> "StepForest":
        return trees if isinstance(trees, StepForest) else StepForest(tuple(trees))

    def __len__(self) -> int:
        return len(self.trees)

    def __iter__(self):
        return iter(self.trees)

    def __getitem__(self, row: int) -> DraftTree:
        return self.trees[row]

    @property
    def rows(self) -> int:
        return len(self.trees)

    @cached_property
    def sizes(self) -> np.ndarray:
        """[B] nodes per row, roots included."""
        return np.array([len(t) for t in self.trees], dtype=np.int64)

    @property
    def width(self) -> int:
        """Slots per row in the pass: the widest row's node count."""
        return int(self.sizes.max())

    @property
    def pass_tokens(self) -> int:
        """Tokens the padded pass computes: B x width."""
        return self.rows * self.width

    @cached_property
    def num_nodes(self) -> int:
        """Real nodes over all rows (padding excluded), roots included (summed in Python: read on
        every step's critical path, where a numpy call on a cold cache costs more than the sum)."""
        return sum(len(tree) for tree in self.trees)

    @cached_property
    def num_drafted(self) -> int:
        return self.num_nodes - self.rows

    @cached_property
    def offsets(self) -> np.ndarray:
        """[B + 1] flat index of each row's root; the last entry is `num_nodes`."""
        return np.array(self.row_starts, dtype=np.int64)

    @cached_property
    def row_starts(self) -> tuple[int, ...]:
        """`offsets` as a tuple (read in plain Python on every step's critical path)."""
        return (0, *accumulate(len(tree) for tree in self.trees))

    @cached_property
    def parents(self) -> np.ndarray:
        """[N] flat parent of each node, -1 for every row's root."""
        return np.concatenate([np.where(t.parents.numpy() >= 0, t.parents.numpy() + o, -1)
                               for t, o in zip(self.trees, self.offsets)])

    @cached_property
    def depths(self) -> np.ndarray:
        """[N] depth of each node."""
        return np.array([depth for tree in self.trees for depth in tree.depth_list], dtype=np.int64)

    @cached_property
    def scores(self) -> np.ndarray:
        """[N] float64 cumulative draft log-probability."""
        return np.concatenate([t.scores.double().numpy() for t in self.trees])

    @cached_property
    def tokens(self) -> torch.Tensor:
        """[N] long token ids."""
        return self.trees[0].tokens if self.rows == 1 else torch.cat([t.tokens for t in self.trees])

    @cached_property
    def row_of(self) -> np.ndarray:
        """[N] the row each node belongs to."""
        return np.repeat(np.arange(self.rows), self.sizes)

    @cached_property
    def max_depth(self) -> int:
        return max(tree.max_depth for tree in self.trees)

    def split(self, values):
        """Per-node values [N] (or [..., N, ...] along `dim=0` for numpy / torch) -> one chunk per row."""
        if isinstance(values, torch.Tensor):
            return list(values.split(self.sizes.tolist()))
        return np.split(np.asarray(values), self.offsets[1:-1])

    def local(self, flat_nodes: Sequence[int]) -> list[list[int]]:
        """Flat node indices -> per row, that row's own node indices (in the given order)."""
        if self.rows == 1:  # one row: flat indices are its own
            return [[int(node) for node in flat_nodes]]
        out: list[list[int]] = [[] for _ in range(self.rows)]
        for node in flat_nodes:
            row = int(self.row_of[node])
            out[row].append(int(node) - int(self.offsets[row]))
        return out

    def subforest(self, keeps: Sequence[Sequence[int]]) -> "StepForest":
        """Each row's tree restricted to its `keeps[b]` (root included, closed under parents)."""
        return StepForest(tuple(subtrees(self.trees, keeps)))
