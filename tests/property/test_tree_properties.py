"""Random draft trees and forests against their invariants, masks, positions and paths."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from moe_spec.core.forest import StepForest
from moe_spec.core.tree import DraftTree, ancestor_mask, chain_tree, path_to, positions, root_to_leaf_paths
from tree_strategies import bounded, closed_subsets, forests, reference_ancestors, tree_parents, trees

FAST = bounded(150)


@FAST
@given(trees())
def test_depths_count_the_ancestors(tree):
    parents, depths = tree.parents.tolist(), tree.depths.tolist()
    # the cached Python forms the controllers read are the tensors'
    assert list(tree.parent_list) == parents and list(tree.depth_list) == depths and tree.max_depth == max(depths)
    assert list(tree.rank_list) == tree.sibling_ranks.tolist() and list(tree.score_list) == tree.scores.tolist()
    assert depths[0] == 0
    for node in range(1, len(tree)):
        assert parents[node] < node
        assert depths[node] == depths[parents[node]] + 1 == len(reference_ancestors(parents, node)) - 1


@FAST
@given(trees(), st.integers(0, 500))
def test_mask_is_exactly_each_node_and_its_ancestors(tree, prefix_len):
    parents = tree.parents.tolist()
    mask = ancestor_mask(tree)
    assert mask.shape == (len(tree), len(tree)) and mask.dtype == torch.bool
    for node in range(len(tree)):
        assert mask[node].nonzero().flatten().tolist() == reference_ancestors(parents, node)
        assert path_to(tree, node) == reference_ancestors(parents, node)
    assert bool(torch.equal(mask, mask.tril())), "a node never sees a later node"
    pos = positions(tree, prefix_len)
    assert torch.equal(pos, prefix_len + mask.sum(1) - 1), "position = prefix + ancestors"


@FAST
@given(trees())
def test_root_to_leaf_paths_cover_every_node_once_per_leaf(tree):
    parents = tree.parents.tolist()
    leaves = [node for node in range(len(tree)) if node not in parents]
    paths = root_to_leaf_paths(tree)
    assert [path[-1] for path in paths] == leaves
    for path in paths:
        assert path[0] == 0 and path == reference_ancestors(parents, path[-1])
    assert set().union(*map(set, paths)) == set(range(len(tree)))


@FAST
@given(st.data())
def test_subtree_keeps_tokens_depths_and_the_restricted_mask(data):
    tree = data.draw(trees())
    keep = data.draw(closed_subsets(tree))
    sub = tree.subtree(keep)
    index = torch.tensor(keep)
    assert len(sub) == len(keep)
    assert torch.equal(sub.tokens, tree.tokens[index]) and torch.equal(sub.scores, tree.scores[index])
    assert torch.equal(sub.depths, tree.depths[index])
    assert torch.equal(ancestor_mask(sub), ancestor_mask(tree)[index][:, index])


@FAST
@given(st.data())
def test_subtree_refuses_a_set_missing_a_parent(data):
    tree = data.draw(trees())
    if len(tree) < 3 or int(tree.depths.max()) < 2:
        return  # no node whose parent can be dropped while keeping the root
    deep = [node for node in range(len(tree)) if int(tree.depths[node]) >= 2]
    node = data.draw(st.sampled_from(deep))
    keep = [n for n in path_to(tree, node) if n != int(tree.parents[node])]
    with pytest.raises(ValueError):
        tree.subtree(keep)


@FAST
@given(tree_parents(), st.integers(1, 23))
def test_a_parent_that_is_not_earlier_is_refused(parents, bad_at):
    if len(parents) < 2:
        return
    node = bad_at % (len(parents) - 1) + 1
    broken = list(parents)
    broken[node] = node  # itself: not a smaller index
    with pytest.raises(ValueError):
        DraftTree.from_lists([0] * len(parents), broken)


@FAST
@given(st.lists(st.integers(0, 95), min_size=1, max_size=30))
def test_chain_tree_is_one_path(tokens):
    tree = chain_tree(tokens)
    assert tree.depths.tolist() == list(range(len(tokens)))
    assert root_to_leaf_paths(tree) == [list(range(len(tokens)))]


@FAST
@given(forests())
def test_forest_layout_matches_its_trees(trees_):
    forest = StepForest(tuple(trees_))
    sizes = [len(t) for t in trees_]
    assert forest.sizes.tolist() == sizes and forest.width == max(sizes)
    assert forest.pass_tokens == len(trees_) * max(sizes) >= forest.num_nodes == sum(sizes)
    assert forest.num_drafted == sum(sizes) - len(trees_)
    assert forest.offsets.tolist() == np.concatenate([[0], np.cumsum(sizes)]).tolist()
    assert torch.equal(forest.tokens, torch.cat([t.tokens for t in trees_]))
    for row, tree in enumerate(trees_):
        start, end = forest.offsets[row], forest.offsets[row + 1]
        local = forest.parents[start:end]
        assert local[0] == -1 and (local[1:] - start).tolist() == tree.parents[1:].tolist()
        assert forest.depths[start:end].tolist() == tree.depths.tolist()
        assert (forest.row_of[start:end] == row).all()
    assert forest.max_depth == max(int(t.depths.max()) for t in trees_)
    assert list(forest.row_starts) == forest.offsets.tolist() and forest.num_nodes == sum(sizes)
    chunks = forest.split(torch.arange(forest.num_nodes))
    assert [c.tolist() for c in chunks] == [list(range(s, e)) for s, e in zip(forest.offsets[:-1], forest.offsets[1:])]
    flat = list(range(forest.num_nodes))[::-1]
    assert forest.local(flat) == [list(range(s - 1, -1, -1)) for s in sizes]


@FAST
@given(st.data())
def test_subforest_is_each_rows_subtree(data):
    trees_ = data.draw(forests())
    keeps = [data.draw(closed_subsets(t)) for t in trees_]
    featured = data.draw(st.booleans())  # the rows' trees gathered together (`subtrees`), with and without features
    if featured:
        trees_ = [replace(t, node_features=torch.randn(len(t), 3)) for t in trees_]
    sub = StepForest(tuple(trees_)).subforest(keeps)
    assert sub.sizes.tolist() == [len(k) for k in keeps]
    for tree, keep, kept in zip(trees_, keeps, sub):
        index = torch.tensor(sorted(keep))
        assert torch.equal(kept.tokens, tree.tokens[index]) and torch.equal(kept.scores, tree.scores[index])
        assert torch.equal(kept.depths, tree.depths[index]) and kept.depth_list == tuple(kept.depths.tolist())
        assert torch.equal(ancestor_mask(kept), ancestor_mask(tree)[index][:, index])
        assert kept.parent_list == tuple(kept.parents.tolist())
        assert (kept.node_features is None) == (not featured)
        if featured:
            assert torch.equal(kept.node_features, tree.node_features[index])
