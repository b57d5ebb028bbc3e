"""The draft tree: a small immutable value and pure functions over it.

Node 0 is the root: the last committed token, whose key/value is not yet in the target's
cache. Every other node is a drafted token. Nodes are in topological order (a parent comes
before its children), so `parents[i] < i` for every non-root node.

Candidates come in two schemes. *Deterministic* ones (the draft's top tokens, n-gram
continuations) are point-mass proposals and carry nothing more. *Sampled* ones were drawn, at
each node, from a draft distribution q without replacement; the tree then carries q per node
(`proposals`, over the token ids `proposal_ids`) and each node's rank in its parent's draw
sequence (`draw_rank`), because verification by recursive rejection needs them exactly as
drawn, and needs each node's children to be the *first* k draws (a cut may drop later draws of a
node, never an earlier one while keeping a later; see `moe_spec.core.acceptance`).

A tree may also carry, per node, the draft head's output at its parent (`node_features`, asked for
with `TreeBudget.node_features`): what the head computed before proposing the node, from which a
predictor guesses the node's routing (`moe_spec.profile.head_routing`). The root's row is zeros
(its parent's output is never computed). Nothing in drafting or verification reads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class DraftTree:
    tokens: torch.Tensor  # [N] long: token id of each node
    parents: torch.Tensor  # [N] long: parent node index, -1 for the root
    scores: torch.Tensor  # [N] float: cumulative draft log-probability (root 0)
    # sampled candidates only (None: deterministic candidates)
    proposals: torch.Tensor | None = None  # [N, V_q] float: the distribution node i's children were drawn from
    proposal_ids: torch.Tensor | None = None  # [V_q] long: the token id of each column of `proposals`
    draw_rank: torch.Tensor | None = None  # [N] long: 0 for its parent's first draw, 1 for the second, ... (root 0)
    node_features: torch.Tensor | None = None  # [N, D] float: the head's output at each node's parent (root: zeros)

    def __post_init__(self):
        n = self.tokens.shape[0]
        if n == 0:
            raise ValueError("a draft tree has at least its root")
        if self.parents.shape != (n,) or self.scores.shape != (n,):
            raise ValueError(f"tokens, parents and scores must all have shape [{n}]")
        carried = (self.proposals is not None, self.proposal_ids is not None, self.draw_rank is not None)
        if any(carried) and not all(carried):
            raise ValueError("a sampled tree needs proposals, proposal_ids and draw_rank together")
        if all(carried) and (self.proposals.dim() != 2 or self.proposals.shape[0] != n
                             or self.proposal_ids.shape != (self.proposals.shape[1],) or self.draw_rank.shape != (n,)):
            raise ValueError(f"proposals must be [{n}, V_q] with proposal_ids [V_q] and draw_rank [{n}]")
        if self.node_features is not None and (self.node_features.dim() != 2 or self.node_features.shape[0] != n):
            raise ValueError(f"node_features must be [{n}, D], got {tuple(self.node_features.shape)}")
        if int(self.parents[0]) != -1:
            raise ValueError("node 0 must be the root (parent -1)")
        if n > 1:
            rest = self.parents[1:]
            if bool((rest < 0).any()) or bool((rest >= torch.arange(1, n)).any()):
                raise ValueError("every non-root node needs a parent with a smaller index")

    @staticmethod
    def root_only(token: int) -> "DraftTree":
        return DraftTree(
            tokens=torch.tensor([token], dtype=torch.long),
            parents=torch.tensor([-1], dtype=torch.long),
            scores=torch.zeros(1),
        )

    @staticmethod
    def from_lists(tokens: list[int], parents: list[int], scores: list[float] | None = None) -> "DraftTree":
        return DraftTree(
            tokens=torch.tensor(tokens, dtype=torch.long),
            parents=torch.tensor(parents, dtype=torch.long),
            scores=torch.tensor(scores if scores is not None else [0.0] * len(tokens), dtype=torch.float32),
        )

    def __len__(self) -> int:
        n = self.__dict__.get("_len")  # read many times a step: the tensor's shape once
        if n is None:
            n = int(self.tokens.shape[0])
            object.__setattr__(self, "_len", n)
        return n

    @property
    def sampled(self) -> bool:
        """The candidates were drawn from `proposals` (else they are deterministic point masses)."""
        return self.proposals is not None

    def proposal_at(self, node: int, vocab_size: int) -> torch.Tensor:
        """[V] float32: the distribution node `node`'s children were drawn from, over the full vocabulary."""
        q = torch.zeros(vocab_size, dtype=torch.float32)
        q[self.proposal_ids] = self.proposals[node].float()
        return q

    @property
    def num_drafted(self) -> int:
        return len(self) - 1

    # computed once (the tree is immutable): `cached_property` keeps each in the instance's dict,
    # where a frozen dataclass's own fields are untouched
    @cached_property
    def depths(self) -> torch.Tensor:
        """[N] long: distance of each node from the root."""
        return torch.tensor(self.depth_list, dtype=torch.long)

    # the structure as Python tuples: controllers walk a few dozen nodes a step in plain Python,
    # where converting the tensors again on every read costs more than the walk

    @cached_property
    def parent_list(self) -> tuple[int, ...]:
        """`parents` as a tuple."""
        return tuple(self.parents.tolist())

    @cached_property
    def depth_list(self) -> tuple[int, ...]:
        """`depths` as a tuple."""
        parents = self.parent_list
        values = [0] * len(parents)
        for i in range(1, len(parents)):
            values[i] = values[parents[i]] + 1
        return tuple(values)

    @property
    def max_depth(self) -> int:
        """The deepest node's depth (0: the root alone)."""
        return max(self.depth_list)

    @cached_property
    def score_list(self) -> tuple[float, ...]:
        """`scores` as a tuple."""
        return tuple(self.scores.tolist())

    @cached_property
    def rank_list(self) -> tuple[int, ...]:
        """`sibling_ranks` as a tuple."""
        if self.sampled:
            return tuple(self.draw_rank.tolist())
        parents, scores = self.parent_list, self.score_list
        ranks, seen = [0] * len(parents), {}
        for parent, _, node in sorted(zip(parents[1:], [-score for score in scores[1:]], range(1, len(parents)))):
            ranks[node] = seen.get(parent, 0)
            seen[parent] = ranks[node] + 1
        return tuple(ranks)

    @cached_property
    def sibling_ranks(self) -> torch.Tensor:
        """[N] long: each node's rank among its parent's children (0: the first; root 0). Sampled
        candidates are ranked in draw order (`draw_rank`), top candidates by score (the head's
        order of proposing them; ties to the lower index)."""
        return self.draw_rank if self.sampled else torch.tensor(self.rank_list, dtype=torch.long)

    def children(self, node: int) -> list[int]:
        return (self.parents == node).nonzero().flatten().tolist()

    def subtree(self, keep: torch.Tensor | list[int]) -> "DraftTree":
        """The tree restricted to `keep` (node indices; must contain the root and be closed under parents)."""
        return subtrees((self,), (keep,))[0]


def subtrees(trees: Sequence[DraftTree], keeps: Sequence[torch.Tensor | Sequence[int]]) -> list[DraftTree]:
    """Each tree restricted to its `keeps[b]` (`DraftTree.subtree`), the cut trees' tensors gathered
    together: one indexing op per field for a batch's rows instead of one per row (lists, not
    tensor ops, for the rest: this runs on every step's critical path, over a few dozen nodes a row)."""
    out = list(trees)
    cuts: list[tuple[int, list[int], tuple[int, ...]]] = []  # (row, kept nodes, their parents renumbered)
    for row, (tree, keep) in enumerate(zip(trees, keeps)):
        kept = sorted(set(keep.tolist() if isinstance(keep, torch.Tensor) else (int(k) for k in keep)))
        if not kept or kept[0] != 0:
            raise ValueError("a subtree must contain the root")
        if len(kept) == len(tree) and kept[-1] == len(tree) - 1:  # every node
            continue
        if len(kept) == 1 and tree.node_features is None:
            out[row] = DraftTree.root_only(int(tree.tokens[0]))
            continue
        new_index = {old: new for new, old in enumerate(kept)}
        old_parents = tree.parent_list
        try:
            parents = (-1,) + tuple(new_index[old_parents[node]] for node in kept[1:])
        except KeyError:
            raise ValueError("a subtree must contain the parent of every kept node") from None
        cuts.append((row, kept, parents))
    if not cuts:
        return out
    cut_trees = [trees[row] for row, _, _ in cuts]
    sizes = [len(kept) for _, kept, _ in cuts]
    flat, start = [], 0  # the kept nodes' indices into the cut trees side by side
    for tree, (_, kept, _) in zip(cut_trees, cuts):
        flat += [start + node for node in kept]
        start += len(tree)
    index = torch.tensor(flat)

    def gathered(parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each cut tree's kept rows of one field (its tensors `parts`, one per cut tree)."""
        if len(parts) == 1:
            return [parts[0][index]]
        return list(torch.cat(parts)[index].split(sizes))

    tokens, scores = gathered([t.tokens for t in cut_trees]), gathered([t.scores for t in cut_trees])
    carried = [t.node_features is not None for t in cut_trees]
    if all(carried) and len({t.node_features.shape[1] for t in cut_trees}) == 1:
        features = gathered([t.node_features for t in cut_trees])
    else:  # some rows carry none (or of another width): row by row
        features = [t.node_features[torch.tensor(kept)] if t.node_features is not None else None
                    for t, (_, kept, _) in zip(cut_trees, cuts)]
    parents_all = [parent for _, _, parents in cuts for parent in parents]
    parents = list(torch.tensor(parents_all).split(sizes)) if len(cuts) > 1 else [torch.tensor(parents_all)]
    for i, (tree, (row, kept, parent_list)) in enumerate(zip(cut_trees, cuts)):
        sampled = tree.sampled
        rows = torch.tensor(kept) if sampled else None
        # a subtree closed under parents (checked above) of a valid tree is valid, its nodes still in
        # topological order: built without `__post_init__`'s checks (torch calls on every step's critical path)
        sub = object.__new__(DraftTree)
        old_depths = tree.depth_list
        fields = {"tokens": tokens[i], "parents": parents[i], "scores": scores[i],
                  "proposals": tree.proposals[rows] if sampled else None,
                  "proposal_ids": tree.proposal_ids if sampled else None,
                  "draw_rank": tree.draw_rank[rows] if sampled else None, "node_features": features[i],
                  "parent_list": parent_list,  # the cached properties, known here
                  "depth_list": tuple(old_depths[node] for node in kept)}  # depths within a closed subtree are unchanged
        for name, value in fields.items():
            object.__setattr__(sub, name, value)
        out[row] = sub
    return out


def ancestor_mask(tree: DraftTree) -> torch.Tensor:
    """[N, N] bool: entry (i, j) is True when node j is node i or one of its ancestors."""
    n = len(tree)
    mask = torch.eye(n, dtype=torch.bool)
    parents = tree.parents.tolist()
    for i in range(1, n):
        mask[i] |= mask[parents[i]]
    return mask


def positions(tree: DraftTree, prefix_len: int) -> torch.Tensor:
    """[N] long: the absolute position of each node when the cache holds `prefix_len` tokens."""
    return prefix_len + tree.depths


def root_to_leaf_paths(tree: DraftTree) -> list[list[int]]:
    """Node indices of every path from the root to a leaf, in node order of the leaves."""
    is_parent = torch.zeros(len(tree), dtype=torch.bool)
    is_parent[tree.parents[1:]] = True
    parents = tree.parents.tolist()
    paths = []
    for leaf in (~is_parent).nonzero().flatten().tolist():
        path = [leaf]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        paths.append(path[::-1])
    return paths


def path_to(tree: DraftTree, node: int) -> list[int]:
    """Node indices from the root down to `node`."""
    parents = tree.parents.tolist()
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def chain_tree(tokens: list[int]) -> DraftTree:
    """A tree that is a single path: tokens[0] is the root."""
    return DraftTree.from_lists(tokens, list(range(-1, len(tokens) - 1)))
