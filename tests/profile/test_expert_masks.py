import numpy as np
import pytest

from moe_spec.profile.expert_masks import ids_of_mask, masks_of_bits, masks_of_ids


@pytest.mark.parametrize("nodes", [1, 9, 130])
def test_a_nodes_mask_has_its_ids_as_its_bits(nodes):
    """Across a width that is no multiple of 8 (7 layers of 9 experts)."""
    rng = np.random.default_rng(nodes)
    width = 7 * 9
    ids = np.stack([rng.choice(width, size=14, replace=False) for _ in range(nodes)])  # [N, 14]
    masks = masks_of_ids(ids, width)
    assert [ids_of_mask(mask) for mask in masks] == [frozenset(row) for row in ids.tolist()]
    assert masks == [sum(1 << x for x in row) for row in ids.tolist()]
    bits = np.zeros((nodes, width), dtype=bool)
    bits[np.arange(nodes)[:, None], ids] = True
    assert masks_of_bits(bits) == masks


def test_an_empty_mask_has_no_ids():
    assert ids_of_mask(0) == frozenset() and masks_of_bits(np.zeros((2, 5), dtype=bool)) == [0, 0]
