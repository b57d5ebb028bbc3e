"""Top-p from the largest logits (`sampling._nucleus_dropped_from_top`) must drop exactly the tokens
the whole-vocabulary sort drops, and say so (None) wherever it cannot be sure."""

import pytest
import torch

from moe_spec.core.sampling import (NUCLEUS_CANDIDATES, SamplingConfig, _nucleus_dropped_from_top, nucleus_dropped,
                                    nucleus_dropped_sorted, probabilities)


def _peaked_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """[rows, vocab] logits shaped like a language model's: a few likely tokens over a long tail."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 2
    head = torch.randint(0, vocab, (rows, 12), generator=g)
    return logits.scatter_add(1, head, torch.rand(rows, 12, generator=g) * 12)


@pytest.mark.parametrize("vocab", [2048, 8192])
@pytest.mark.parametrize("top_p", [0.5, 0.8, 0.9, 0.95])
def test_the_top_candidates_drop_exactly_what_the_sort_drops(vocab, top_p):
    decided = 0
    for seed in range(40):
        for temperature in (0.5, 0.7, 1.0):
            logits = _peaked_logits(3, vocab, seed) / temperature
            fast = _nucleus_dropped_from_top(logits, top_p)
            if fast is not None:
                decided += 1
                assert torch.equal(fast, nucleus_dropped_sorted(logits, top_p))
            assert torch.equal(nucleus_dropped(logits, top_p), nucleus_dropped_sorted(logits, top_p))
    assert decided >= 40  # the fast path ran, so the comparison above could fail


def test_a_tie_at_the_nucleus_edge_is_left_to_the_sort():
    logits = torch.full((4096,), -20.0)
    logits[:3] = torch.tensor([5.0, 3.0, 3.0])  # the two tied tokens straddle top_p: either could be kept
    mass = logits.softmax(-1)
    top_p = float(mass[0] + mass[1] / 2)
    assert _nucleus_dropped_from_top(logits, top_p) is None
    dropped = nucleus_dropped(logits, top_p)
    assert not dropped[0] and int((~dropped[1:3]).sum()) == 1 and bool(dropped[3:].all())


def test_a_nucleus_wider_than_every_candidate_count_is_sorted():
    logits = torch.zeros(8192)  # uniform: the nucleus holds 90% of the vocabulary
    assert NUCLEUS_CANDIDATES[-1] < 0.9 * 8192
    assert _nucleus_dropped_from_top(logits, 0.9) is None
    assert torch.equal(nucleus_dropped(logits, 0.9), nucleus_dropped_sorted(logits, 0.9))


def test_top_k_then_top_p_on_a_large_vocabulary_filters_like_transformers():
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = _peaked_logits(4, 8192, seed=3)
    for config in (SamplingConfig(0.7, top_p=0.9), SamplingConfig(0.7, top_k=40, top_p=0.8)):
        assert _nucleus_dropped_from_top(logits / 0.7, config.top_p) is not None
        scores = TemperatureLogitsWarper(0.7)(None, logits.clone())
        if config.top_k:
            scores = TopKLogitsWarper(config.top_k)(None, scores)
        scores = TopPLogitsWarper(config.top_p)(None, scores)
        assert torch.allclose(probabilities(logits, config), scores.softmax(-1), atol=1e-6)
        assert torch.equal(probabilities(logits, config) > 0, scores.softmax(-1) > 0)


def test_sampling_by_inverse_cdf_follows_the_distribution_and_never_draws_zero_mass():
    from moe_spec.core.sampling import sample
    from moe_spec.testing.helpers import assert_follows

    generator = torch.Generator().manual_seed(5)
    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.25, 0.05, 0.0])
    counts = torch.zeros(len(probs))
    for _ in range(4000):
        counts[sample(probs * 3.0, generator)] += 1  # an unnormalised vector draws the same law
    assert counts[probs == 0].sum() == 0
    assert_follows(counts, probs)


def test_sampling_refuses_a_distribution_without_mass():
    from moe_spec.core.sampling import sample

    with pytest.raises(ValueError, match="total mass"):
        sample(torch.zeros(5), torch.Generator())
