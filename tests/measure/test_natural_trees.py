"""The profile's natural trees: recorded trees, half of them cut to the sizes a controller verifies."""

import torch

from moe_spec.measure import profiler
from moe_spec.measure.latency import random_tree
from moe_spec.measure.routing_stats import best_first_order


class _Step:
    def __init__(self, tree):
        self._tree = tree

    def tree(self):
        return self._tree


class _Trace:
    def context(self, step):
        return torch.arange(8)


def _pairs(count: int, nodes: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    return [(_Trace(), _Step(random_tree(nodes, 50, generator))) for _ in range(count)]


def test_every_other_natural_tree_is_a_best_first_prefix_of_its_recorded_tree():
    fit, heldout = _pairs(10, 60, 0), _pairs(10, 60, 1)
    natural = profiler._natural_trees(fit, heldout, 16, torch.Generator().manual_seed(0))
    assert [n.split for n in natural] == ["fit"] * 8 + ["heldout"] * 8
    sizes = [len(n.tree) for n in natural]
    assert sizes[0::2] == [60] * 8  # kept whole
    assert all(1 <= size <= 60 for size in sizes[1::2]) and min(sizes[1::2]) < 16  # log-uniform: most are small
    recorded = {id(step.tree()): step.tree() for _, step in fit + heldout}
    for n in natural[1::2]:  # each cut is a prefix of some recorded tree's best-first order
        assert any(torch.equal(n.tree.tokens, tree.subtree(best_first_order(tree)[: len(n.tree)]).tokens)
                   for tree in recorded.values())
    again = profiler._natural_trees(fit, heldout, 16, torch.Generator().manual_seed(0))
    assert [len(n.tree) for n in again] == sizes  # drawn from the profile's generator
