"""Acceptance rules, checked on hand-built trees and against exact distributions."""

import pytest
import torch
from scipy.stats import chisquare

from moe_spec.core.acceptance import accept_greedy, accept_sampled
from moe_spec.core.sampling import SamplingConfig, probabilities
from moe_spec.core.tree import DraftTree


def one_hot_logits(argmaxes, vocab=6):
    logits = torch.zeros(len(argmaxes), vocab)
    for i, a in enumerate(argmaxes):
        logits[i, a] = 5.0
    return logits


def test_greedy_takes_longest_matching_path_plus_bonus():
    #        root(0)
    #       /      \
    #    1:tok3   2:tok4
    #      |        |
    #    3:tok5   4:tok1
    tree = DraftTree.from_lists([9, 3, 4, 5, 1], [-1, 0, 0, 1, 2])
    # target: after root -> 4, after node 2 -> 1, after node 4 -> 2
    acceptance = accept_greedy(tree, one_hot_logits([4, 0, 1, 0, 2]))
    assert acceptance.path == [0, 2, 4]
    assert acceptance.bonus_token == 2
    assert acceptance.new_tokens(tree) == [4, 1, 2]


def test_greedy_rejecting_everything_gives_the_target_token():
    tree = DraftTree.from_lists([9, 3, 4], [-1, 0, 0])
    acceptance = accept_greedy(tree, one_hot_logits([5, 0, 0]))
    assert acceptance.path == [0] and acceptance.new_tokens(tree) == [5]


def test_top_p_and_top_k_filter_like_transformers():
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(0)) * 2
    config = SamplingConfig(temperature=0.7, top_k=9, top_p=0.8)
    scores = TemperatureLogitsWarper(0.7)(None, logits.clone())
    scores = TopKLogitsWarper(9)(None, scores)
    scores = TopPLogitsWarper(0.8)(None, scores)
    assert torch.allclose(probabilities(logits, config), scores.softmax(-1), atol=1e-6)


VOCAB = 5


def _two_level_tree():
    # root with 3 candidate children (siblings), two of which have 2 children each
    tokens = [0, 1, 2, 3, 4, 0, 1, 2]
    parents = [-1, 0, 0, 0, 1, 1, 2, 2]
    return DraftTree.from_lists(tokens, parents)


@pytest.mark.parametrize(
    "config",
    [SamplingConfig(1.0), SamplingConfig(0.8, top_k=3), SamplingConfig(1.3, top_p=0.7)],
    ids=["t1", "topk", "topp"],
)
def test_tree_sampling_preserves_the_target_distribution_over_two_tokens(config):
    tree = _two_level_tree()
    logits = torch.randn(len(tree), VOCAB, generator=torch.Generator().manual_seed(3)) * 1.5
    # exact distribution of the first two emitted tokens: p(a) * p(b | a), where p(b | a) comes
    # from the child node holding a when there is one, else the step ends and b is from the next step.
    # We test the first token exactly, and the second token conditioned on an accepted child.
    p_root = probabilities(logits[0], config)
    generator = torch.Generator().manual_seed(1234)
    samples = 6000
    first = torch.zeros(VOCAB)
    second_given = {node: torch.zeros(VOCAB) for node in (1, 2)}
    for _ in range(samples):
        acceptance = accept_sampled(tree, logits, config, generator)
        new = acceptance.new_tokens(tree)
        first[new[0]] += 1
        if len(acceptance.path) >= 2 and acceptance.path[1] in second_given:
            second_given[acceptance.path[1]][new[1]] += 1
    _assert_matches(first, p_root)
    # siblings hold distinct tokens and a rejected sibling's token leaves the residual, so the first
    # emitted token is a child's token exactly when that child was accepted: P(node) = p_root(its token).
    # The laws tested are those that expect at least 100 draws (a node outside top-k / top-p never is).
    expected = {node: samples * float(p_root[int(tree.tokens[node])]) for node in second_given}
    tested = [node for node in second_given if expected[node] >= 100]
    assert tested, f"no second-token law gets enough draws: {expected}"
    for node in tested:
        _assert_matches(second_given[node], probabilities(logits[node], config))


def _assert_matches(counts, probs):
    support = probs > 0
    assert counts[~support].sum() == 0, "sampled a token the target gives zero probability"
    observed = counts[support]
    expected = probs[support] / probs[support].sum() * observed.sum()
    # too few draws would pass any law: the callers size their draws so that every law they test gets enough
    assert observed.sum() >= 50, f"only {int(observed.sum())} draws to test this law"
    if observed.numel() < 2:  # one token with mass: every draw must be it, which the support check above holds
        return
    assert chisquare(observed.numpy(), expected.numpy()).pvalue > 1e-3


def test_sampling_with_a_point_mass_target_always_accepts_the_matching_child():
    tree = DraftTree.from_lists([0, 2, 3], [-1, 0, 0])
    logits = torch.full((3, VOCAB), -1e4)
    logits[0, 3] = 0.0
    logits[2, 1] = 0.0
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        acceptance = accept_sampled(tree, logits, SamplingConfig(1.0), generator)
        assert acceptance.path == [0, 2] and acceptance.bonus_token == 1


def test_acceptance_is_reproducible_with_a_seeded_generator():
    tree = _two_level_tree()
    logits = torch.randn(len(tree), VOCAB, generator=torch.Generator().manual_seed(5))
    runs = [
        [accept_sampled(tree, logits, SamplingConfig(1.0), g).new_tokens(tree) for _ in range(30)]
        for g in (torch.Generator().manual_seed(7), torch.Generator().manual_seed(7))
    ]
    assert runs[0] == runs[1]


def test_first_two_tokens_through_a_full_level_of_siblings():
    """Every token drafted at depth 1 and, below the child holding token 0, every token at depth 2."""
    tokens = [0] + list(range(VOCAB)) + list(range(VOCAB))
    parents = [-1] + [0] * VOCAB + [1] * VOCAB
    tree = DraftTree.from_lists(tokens, parents)
    logits = torch.randn(len(tree), VOCAB, generator=torch.Generator().manual_seed(11))
    config = SamplingConfig(1.0)
    generator = torch.Generator().manual_seed(99)
    first = torch.zeros(VOCAB)
    second_after_0 = torch.zeros(VOCAB)
    for _ in range(5000):
        acceptance = accept_sampled(tree, logits, config, generator)
        new = acceptance.new_tokens(tree)
        assert len(new) >= 2, "with every token drafted, the first token is always accepted"
        first[new[0]] += 1
        if new[0] == 0:
            second_after_0[new[1]] += 1
    _assert_matches(first, probabilities(logits[0], config))
    _assert_matches(second_after_0, probabilities(logits[1], config))
