import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_spec.core.tree import DraftTree, ancestor_mask, chain_tree, path_to, positions, root_to_leaf_paths


@st.composite
def trees(draw, max_nodes=24):
    n = draw(st.integers(1, max_nodes))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = draw(st.lists(st.integers(0, 50), min_size=n, max_size=n))
    return DraftTree.from_lists(tokens, parents)


@given(trees())
@settings(max_examples=60, deadline=None)
def test_ancestor_mask_matches_paths(tree):
    mask = ancestor_mask(tree)
    for node in range(len(tree)):
        expected = torch.zeros(len(tree), dtype=torch.bool)
        expected[path_to(tree, node)] = True
        assert torch.equal(mask[node], expected)
    assert bool(mask[:, 0].all()), "every node sees the root"
    assert bool(mask.diagonal().all()), "every node sees itself"
    assert not bool(mask.triu(1).any()), "no node sees a later node (topological order)"


@given(trees())
@settings(max_examples=60, deadline=None)
def test_positions_are_prefix_plus_depth(tree):
    pos = positions(tree, 17)
    assert int(pos[0]) == 17
    for node in range(1, len(tree)):
        assert int(pos[node]) == int(pos[int(tree.parents[node])]) + 1
    assert torch.equal(tree.depths, ancestor_mask(tree).sum(1) - 1)


@given(trees())
@settings(max_examples=60, deadline=None)
def test_paths_cover_every_node_and_end_in_leaves(tree):
    paths = root_to_leaf_paths(tree)
    covered = {node for path in paths for node in path}
    assert covered == set(range(len(tree)))
    for path in paths:
        assert path[0] == 0
        assert tree.children(path[-1]) == []
        for parent, child in zip(path, path[1:]):
            assert int(tree.parents[child]) == parent


@given(trees(), st.data())
@settings(max_examples=40, deadline=None)
def test_subtree_closed_under_parents_keeps_structure(tree, data):
    leaf = data.draw(st.integers(0, len(tree) - 1))
    keep = path_to(tree, leaf)
    sub = tree.subtree(keep)
    assert len(sub) == len(keep)
    assert sub.tokens.tolist() == tree.tokens[keep].tolist()
    assert sub.depths.tolist() == list(range(len(keep)))


def test_invalid_trees_are_rejected():
    with pytest.raises(ValueError, match="root"):
        DraftTree.from_lists([1, 2], [0, 0])
    with pytest.raises(ValueError, match="smaller index"):
        DraftTree.from_lists([1, 2, 3], [-1, 2, 0])
    with pytest.raises(ValueError, match="at least its root"):
        DraftTree.from_lists([], [])
    tree = DraftTree.from_lists([1, 2, 3], [-1, 0, 1])
    with pytest.raises(ValueError, match="parent"):
        tree.subtree([0, 2])
    with pytest.raises(ValueError, match="root"):
        tree.subtree([1, 2])


def test_chain_tree_is_a_path():
    tree = chain_tree([4, 5, 6])
    assert root_to_leaf_paths(tree) == [[0, 1, 2]]
    assert torch.equal(ancestor_mask(tree), torch.tril(torch.ones(3, 3, dtype=torch.bool)))


@given(trees(), st.data())
@settings(max_examples=40, deadline=None)
def test_a_subtree_of_any_closed_set_keeps_parents_depths_and_features(tree, data):
    chosen = data.draw(st.lists(st.integers(0, len(tree) - 1), max_size=len(tree)))
    keep = sorted({node for leaf in chosen for node in path_to(tree, leaf)} | {0})
    features = torch.arange(len(tree) * 2, dtype=torch.float32).view(len(tree), 2)
    tree = DraftTree(tree.tokens, tree.parents, tree.scores, node_features=features)
    sub = tree.subtree(keep + keep[-1:])  # a repeated index is kept once
    assert sub.tokens.tolist() == tree.tokens[keep].tolist()
    assert torch.equal(sub.node_features, features[keep])
    assert [keep[p] if p >= 0 else -1 for p in sub.parents.tolist()] == [int(tree.parents[k]) for k in keep]
    fresh = DraftTree(sub.tokens, sub.parents, sub.scores)  # depths computed from the parents; checked as any tree
    assert sub.depths.tolist() == fresh.depths.tolist()
    # `subtree` builds without the constructor's checks: what it built passes them
    DraftTree(sub.tokens, sub.parents, sub.scores, node_features=sub.node_features)


def test_a_subtree_missing_a_parent_or_the_root_is_refused():
    tree = chain_tree([5, 6, 7, 8])
    with pytest.raises(ValueError, match="parent"):
        tree.subtree([0, 2])
    with pytest.raises(ValueError, match="root"):
        tree.subtree([1, 2])
