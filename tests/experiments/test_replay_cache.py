"""The replayed offload cache admits and evicts as the live one does, and prices passes by their misses."""

import numpy as np
import pytest
import torch

from moe_spec.errors import InputError
from moe_spec.experiments.replay_cache import Pricing, ReplayCache
from moe_spec.offload.resident_cache import Eviction
from moe_spec.profile.cost_model import CostModel
from moe_spec.profile.fetch_cost import FetchCost


def _layers(*experts):
    return [np.array(e, dtype=np.int64) for e in experts]


def test_passes_miss_what_is_not_resident_and_evict_the_least_recently_used():
    cache = ReplayCache(num_layers=2, num_experts=8, resident=3)
    assert cache.visit(_layers([0, 1], [4])) == [2, 1]  # cold
    assert cache.visit(_layers([1, 2], [4, 5])) == [1, 1]
    assert cache.residency().tolist()[0][:4] == [True, True, True, False]
    # layer 0 holds 0, 1, 2 (0 used longest ago): 3 evicts 0; peeking changes nothing
    assert cache.misses(_layers([0, 3], [4])) == [1, 0]
    assert cache.visit(_layers([3], [4])) == [1, 0]
    assert cache.residency()[0].nonzero().flatten().tolist() == [1, 2, 3]
    # a pass needing more than the cache holds misses the overflow too, on every such pass
    assert cache.visit(_layers([4, 5, 6, 7], [])) == [4, 0]
    assert cache.visit(_layers([4, 5, 6, 7], [])) == [1, 0]
    cache.clear()
    assert not bool(cache.residency().any())


def test_lfu_keeps_the_expert_used_most():
    cache = ReplayCache(num_layers=1, num_experts=4, resident=2, eviction=Eviction.LFU)
    for _ in range(3):
        cache.visit(_layers([0]))
    cache.visit(_layers([1]))
    cache.visit(_layers([2]))  # evicts 1 (used once), not 0 (used three times)
    assert cache.residency()[0].tolist() == [True, False, True, False]


def test_a_pass_costs_its_compute_plus_the_fetch_of_its_misses():
    fetch = FetchCost(counts=(1, 2), ms=((1.0, 1.5),))
    cost = CostModel(2.0, 0.5, (0.25,), 1, "test", fetch=fetch)
    assert Pricing(cost).passes(4).residency is None
    with pytest.raises(InputError, match=r"resident experts \(2\) need a cost model with a fetch cost"):
        Pricing(CostModel(2.0, 0.5, (0.25,), 1, "test"), resident=2)
    with pytest.raises(InputError, match=r"resident experts must be 1..4 per layer"):
        Pricing(cost, resident=5).passes(4)
    passes = Pricing(cost, resident=2).passes(4)
    assert isinstance(passes.residency(), torch.Tensor) and passes.residency().shape == (1, 4)
