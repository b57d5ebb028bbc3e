"""Hypothesis strategies for the property tests: draft trees of every shape, forests, logits.

Small vocabularies on purpose: siblings then often carry the same token, and the target's argmax
often hits a drafted token, so acceptance walks deep instead of stopping at the root.
"""

from __future__ import annotations

import torch
from hypothesis import Phase, settings, strategies as st

from moe_spec.core.tree import DraftTree

SHAPES = ("random", "recent", "chain", "star", "full")


def bounded(examples: int, derandomize: bool = False) -> settings:
    """A fixed number of examples, no deadline (a busy machine must not fail a test), no example
    database (each run stands alone). `derandomize` for statistical checks, so that a check that
    passes keeps passing; they report their first failing example unshrunk (each case samples
    thousands of steps, shrinking would take minutes)."""
    phases = (Phase.explicit, Phase.generate) if derandomize else tuple(Phase)
    return settings(max_examples=examples, deadline=None, database=None, derandomize=derandomize, phases=phases)


def parents_of_full_tree(branching: int, depth: int) -> list[int]:
    """Breadth-first parents of the complete tree with `branching` children per node, `depth` levels."""
    parents, level = [-1], [0]
    for _ in range(depth):
        next_level = []
        for node in level:
            for _ in range(branching):
                parents.append(node)
                next_level.append(len(parents) - 1)
        level = next_level
    return parents


@st.composite
def tree_parents(draw, max_nodes: int = 24) -> list[int]:
    """Parent links of a topologically ordered tree (`parents[i] < i`) of one of `SHAPES`."""
    shape = draw(st.sampled_from(SHAPES))
    if shape == "full":
        branching = draw(st.integers(1, 3))
        depth = draw(st.integers(0, 3 if branching < 3 else 2))
        return parents_of_full_tree(branching, depth)
    n = draw(st.integers(1, max_nodes))
    if shape == "chain":
        return list(range(-1, n - 1))
    if shape == "star":
        return [-1] + [0] * (n - 1)
    low = (lambda i: max(0, i - 3)) if shape == "recent" else (lambda i: 0)  # "recent": deep, narrow trees
    return [-1] + [draw(st.integers(low(i), i - 1)) for i in range(1, n)]


@st.composite
def trees(draw, max_nodes: int = 24, vocab: int = 6) -> DraftTree:
    """A deterministic-candidate draft tree over token ids [0, vocab) (duplicate siblings likely)."""
    parents = draw(tree_parents(max_nodes))
    n = len(parents)
    tokens = draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n))
    scores = [0.0] + draw(st.lists(st.floats(-20.0, 0.0), min_size=n - 1, max_size=n - 1))
    return DraftTree.from_lists(tokens, parents, scores)


@st.composite
def forests(draw, max_rows: int = 4, max_nodes: int = 12, vocab: int = 6) -> list[DraftTree]:
    return draw(st.lists(trees(max_nodes, vocab), min_size=1, max_size=max_rows))


@st.composite
def closed_subsets(draw, tree: DraftTree) -> list[int]:
    """Node indices containing the root and closed under parents (what `subtree` accepts)."""
    parents = tree.parents.tolist()
    keep = [0]
    kept = {0}
    for node in range(1, len(tree)):
        if parents[node] in kept and draw(st.booleans()):
            keep.append(node)
            kept.add(node)
    return keep


def node_logits(draw, n: int, vocab: int) -> torch.Tensor:
    """[n, vocab] float logits with a unique argmax per row (integers plus tiny distinct offsets)."""
    values = draw(st.lists(st.integers(-4, 4), min_size=n * vocab, max_size=n * vocab))
    return torch.tensor(values, dtype=torch.float32).reshape(n, vocab) + torch.arange(vocab) * 1e-3


def reference_ancestors(parents: list[int], node: int) -> list[int]:
    """`node` and its ancestors, by walking parent links: the test's own reference."""
    out = [node]
    while parents[out[-1]] >= 0:
        out.append(parents[out[-1]])
    return sorted(out)
