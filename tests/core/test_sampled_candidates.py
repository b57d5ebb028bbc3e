"""Sampled candidates (drawn from the draft distribution q, verified by recursive rejection with q)
keep the target's distribution exactly: on hand-made trees, end to end through the EAGLE drafter on
every architecture, with top-k and top-p, in batches; and a q that is not the one drawn from breaks
it (the tests can fail)."""

import pytest
import torch

from moe_spec import SpecDecoder, TreeBudget
from moe_spec.core.acceptance import accept_sampled, conditional_acceptance
from moe_spec.core.sampling import SamplingConfig
from moe_spec.core.target import TargetModel
from moe_spec.core.tree import DraftTree
from moe_spec.drafters.eagle import EagleDrafter
from moe_spec.drafters.eagle_config import config_for_target
from moe_spec.drafters.eagle_head import EagleHead
from moe_spec.testing.helpers import assert_follows, exact_distribution_of_tokens_2_and_3
from moe_spec.testing.tiny_models import MOE_ARCHITECTURES, tiny_model

VOCAB = 6
PROMPT = [1, 4, 2, 5]


def sampled_root_tree(q: torch.Tensor, k: int, generator: torch.Generator) -> DraftTree:
    """The root and k children drawn from q without replacement (sequentially, the textbook way)."""
    tokens, left = [0], q.clone()
    for _ in range(k):
        if float(left.sum()) <= 0:
            break
        x = int(torch.multinomial(left / left.sum(), 1, generator=generator))
        tokens.append(x)
        left[x] = 0.0
    n = len(tokens)
    proposals = torch.zeros(n, len(q))
    proposals[0] = q
    return DraftTree(torch.tensor(tokens), torch.tensor([-1] + [0] * (n - 1)), torch.zeros(n), proposals,
                     torch.arange(len(q)), torch.tensor([0] + list(range(n - 1))))


@pytest.mark.parametrize("k", [1, 2, 4])
def test_recursive_rejection_emits_the_target_distribution(k):
    p_logits = torch.log(torch.tensor([0.05, 0.4, 0.3, 0.2, 0.05]))
    q = torch.tensor([0.3, 0.1, 0.1, 0.2, 0.3])  # far from p: rejections and residuals do the work
    p = p_logits.softmax(-1)
    generator = torch.Generator().manual_seed(k)
    counts = torch.zeros(5)
    samples = 6000
    for _ in range(samples):
        tree = sampled_root_tree(q, k, generator)
        logits = p_logits.expand(len(tree), 5)
        counts[accept_sampled(tree, logits, SamplingConfig(1.0), generator).new_tokens(tree)[0]] += 1
    from scipy.stats import chisquare

    assert chisquare(counts.numpy(), (p * samples).numpy()).pvalue > 1e-3


def test_conditional_acceptance_matches_observed_acceptance():
    p_logits = torch.log(torch.tensor([0.1, 0.5, 0.2, 0.2]))
    q = torch.tensor([0.4, 0.3, 0.2, 0.1])
    generator = torch.Generator().manual_seed(3)
    expected_any, observed_any, samples = 0.0, 0, 4000
    for _ in range(samples):
        tree = sampled_root_tree(q, 2, generator)
        logits = p_logits.expand(len(tree), 4)
        probs = conditional_acceptance(tree, logits, SamplingConfig(1.0))
        assert probs[0] == 1.0 and 0.0 <= float(probs[1:].sum()) <= 1.0 + 1e-9
        expected_any += float(probs[1:].sum())
        observed_any += accept_sampled(tree, logits, SamplingConfig(1.0), generator).num_accepted
    # P(some child accepted): the exact per-node probabilities against the walk's outcomes
    assert abs(expected_any / samples - observed_any / samples) < 0.03


def test_a_cut_that_keeps_a_later_draw_without_an_earlier_one_is_refused():
    q = torch.full((4,), 0.25)
    tree = sampled_root_tree(q, 3, torch.Generator().manual_seed(0))
    cut = tree.subtree([0, 2, 3])  # drops the first draw, keeps the second and third
    with pytest.raises(ValueError, match="first draws"):
        accept_sampled(cut, torch.zeros(len(cut), 4), SamplingConfig(1.0), None)
    assert len(tree.subtree([0, 1, 2]).proposals) == 3  # dropping later draws is fine


def eagle_decoder(model, budget: TreeBudget, perturb: bool = False, controller=None) -> SpecDecoder:
    target = TargetModel(model)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        head = EagleHead(config_for_target(target, draft_vocab_size=VOCAB), torch.randperm(VOCAB)).eval()
        with torch.no_grad():
            head.lm_head.weight.mul_(6.0)  # a decisive draft: q far from uniform, so a wrong q shows
    drafter = EagleDrafter(head, target, budget)
    if perturb:
        drafter = PerturbedProposals(drafter)
    return SpecDecoder(target, drafter=drafter, controller=controller)


class PerturbedProposals:
    """The EAGLE drafter with every carried q flattened towards uniform: the draws are still from the
    true q, so verification against the carried one must go wrong."""

    def __init__(self, inner: EagleDrafter):
        self.inner, self.default_budget = inner, inner.default_budget

    def begin(self, prompts, features):
        self.inner.begin(prompts, features)

    def commit(self, tokens, features):
        self.inner.commit(tokens, features)

    def keep_rows(self, rows):
        self.inner.keep_rows(rows)

    def propose(self, roots, budget, max_depths, sampling, generator=None):
        trees = self.inner.propose(roots, budget, max_depths, sampling, generator=generator)
        out = []
        for tree in trees:
            flat = tree.proposals.sqrt()
            flat = flat / flat.sum(-1, keepdim=True).clamp(min=1e-12)
            out.append(DraftTree(tree.tokens, tree.parents, tree.scores, flat, tree.proposal_ids, tree.draw_rank))
        return out


def pair_counts(decoder, config: SamplingConfig, seed: int, samples: int = 1200, batch: bool = False):
    ids = torch.tensor([PROMPT, [0, 0, 2, 5]]) if batch else torch.tensor([PROMPT])
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]]) if batch else None
    generator = torch.Generator().manual_seed(seed)
    counts = torch.zeros(VOCAB, VOCAB)
    drafted = 0
    for _ in range(samples):
        result = decoder.generate(ids, attention_mask=mask, max_new_tokens=4, temperature=config.temperature,
                                  top_k=config.top_k, top_p=config.top_p, eos_token_id=[], generator=generator)
        _x1, x2, x3, _x4 = result.sequences[0, len(PROMPT):].tolist()
        counts[x2, x3] += 1
        drafted += sum(s.tree_size for s in result.stats.steps)
    assert drafted > samples, "the drafter drafted (sampled trees went through verification)"
    return counts


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_sampled_eagle_trees_follow_the_target_on_every_architecture(arch):
    model = tiny_model(arch, vocab_size=VOCAB, seed=4)
    config = SamplingConfig(1.0)
    counts = pair_counts(eagle_decoder(model, TreeBudget(6, 2, 3, sampled=True)), config, seed=len(arch))
    assert_follows(counts, exact_distribution_of_tokens_2_and_3(model, PROMPT, VOCAB, config))


@pytest.mark.parametrize(
    "config", [SamplingConfig(0.7, top_p=0.9), SamplingConfig(0.9, top_k=4)], ids=["chat-top-p", "top-k"]
)
def test_sampled_eagle_trees_follow_the_target_with_top_k_and_top_p(config):
    model = tiny_model("qwen3_moe", vocab_size=VOCAB, seed=4)
    counts = pair_counts(eagle_decoder(model, TreeBudget(8, 3, 3, sampled=True)), config, seed=5)
    assert_follows(counts, exact_distribution_of_tokens_2_and_3(model, PROMPT, VOCAB, config))


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_sampled_chains_follow_the_target(arch):
    """moe-aware's sampled candidates: chains, one draw per depth (branching 1), at a chat-like setting."""
    model = tiny_model(arch, vocab_size=VOCAB, seed=4)
    config = SamplingConfig(0.7, top_p=0.9)
    counts = pair_counts(eagle_decoder(model, TreeBudget(3, 3, 1, sampled=True)), config, seed=7 + len(arch))
    assert_follows(counts, exact_distribution_of_tokens_2_and_3(model, PROMPT, VOCAB, config))


def test_chains_sized_from_the_acceptance_they_reach_follow_the_target():
    """moe-aware sizing sampled chains from per-depth acceptance it keeps learning (persisted across
    calls, so lengths change as the trials come in): every length is fixed before its draws."""
    from dataclasses import replace

    from moe_spec.drafters.lookup import LookupDrafter
    from moe_spec.measure.latency import TimingConfig
    from moe_spec.measure.profiler import ProfileSettings, build_profile
    from moe_spec.policy.moe_aware import MoeAwareController
    from moe_spec.profile.sampling_acceptance import SettingAcceptance

    model = tiny_model("qwen3_moe", vocab_size=VOCAB, seed=4)
    target = TargetModel(model)
    settings = ProfileSettings(max_new_tokens=12, prefix_len=8, grid_tokens=(1, 4), grid_experts=(2, 4),
                               natural_trees=4, curve_sizes=(1, 2, 4), timing=TimingConfig(2, 1, 0))
    profile = build_profile(target, LookupDrafter(), [torch.tensor(PROMPT * 3), torch.tensor(PROMPT[::-1] * 3)], settings)
    config = SamplingConfig(0.7, top_p=0.9)
    entry = SettingAcceptance(0.7, 0, 0.9, True, 2.5, 10, 60, profile.calibration, "chain:3", (0.9, 0.8, 0.7))
    controller = MoeAwareController(replace(profile, sampling_acceptance=(entry,)), scheme="sampled", persist=True,
                                    probe_every=1)  # every step drafts: the gate would pause a random head
    lengths = []
    observe = controller.observe
    controller.observe = lambda record: (lengths.append(record.verified.num_drafted), observe(record))
    counts = pair_counts(eagle_decoder(model, TreeBudget(60, 5, 10), controller=controller), config, seed=13)
    assert len(set(lengths)) > 1 and controller._chain.counts, "the lengths moved with what was learned"
    assert_follows(counts, exact_distribution_of_tokens_2_and_3(model, PROMPT, VOCAB, config))


def test_sampled_eagle_trees_in_a_batch_keep_each_rows_distribution():
    model = tiny_model("deepseek_v3", vocab_size=VOCAB, seed=4)
    config = SamplingConfig(1.0)
    counts = pair_counts(eagle_decoder(model, TreeBudget(8, 2, 3, sampled=True)), config, seed=9, batch=True)
    assert_follows(counts, exact_distribution_of_tokens_2_and_3(model, PROMPT, VOCAB, config))


def test_a_perturbed_proposal_fails_the_distribution_test():
    model = tiny_model("qwen3_moe", vocab_size=VOCAB, seed=4)
    config = SamplingConfig(1.0)
    counts = pair_counts(eagle_decoder(model, TreeBudget(6, 2, 3, sampled=True), perturb=True), config, seed=1)
    with pytest.raises(AssertionError):
        assert_follows(counts, exact_distribution_of_tokens_2_and_3(model, PROMPT, VOCAB, config))


def test_lookup_candidates_under_sampling_follow_the_target():
    """The lookup drafter's n-gram continuations (deterministic candidates) under top-p sampling."""
    from moe_spec.drafters.lookup import LookupDrafter

    model = tiny_model("olmoe", vocab_size=VOCAB, seed=4)
    prompt = [1, 4, 2, 5, 1, 4, 2, 5, 1, 4]  # repeats: lookup finds continuations to propose
    config = SamplingConfig(0.8, top_p=0.9)
    decoder = SpecDecoder(model, drafter=LookupDrafter())
    generator = torch.Generator().manual_seed(21)
    counts, drafted = torch.zeros(VOCAB, VOCAB), 0
    for _ in range(1200):
        result = decoder.generate(torch.tensor([prompt]), max_new_tokens=4, temperature=config.temperature,
                                  top_p=config.top_p, eos_token_id=[], generator=generator)
        _x1, x2, x3, _x4 = result.sequences[0, len(prompt):].tolist()
        counts[x2, x3] += 1
        drafted += sum(s.tree_size for s in result.stats.steps)
    assert drafted > 1200
    assert_follows(counts, exact_distribution_of_tokens_2_and_3(model, prompt, VOCAB, config))


def test_the_walk_reports_each_tried_candidates_exact_acceptance():
    """`Acceptance.trials`: the candidates tried, in order up to the accepted one (all when none
    was), each with P(accepted | its turn came); the turn's chance times it is the exact
    `conditional_acceptance` of that node, whichever were tried."""
    p_logits = torch.log(torch.tensor([0.1, 0.5, 0.2, 0.15, 0.05]))
    q = torch.tensor([0.4, 0.3, 0.2, 0.05, 0.05])
    generator = torch.Generator().manual_seed(11)
    for _ in range(200):
        tree = sampled_root_tree(q, 3, generator)
        logits = p_logits.expand(len(tree), 5)
        exact = conditional_acceptance(tree, logits, SamplingConfig(1.0))
        acceptance = accept_sampled(tree, logits, SamplingConfig(1.0), generator)
        nodes = [node for node, _ in acceptance.trials]
        last = acceptance.path[1] if acceptance.num_accepted else len(tree) - 1
        assert nodes == list(range(1, last + 1)), "tried in order, up to the accepted one"
        turn = 1.0
        for node, probability in acceptance.trials:
            assert 0.0 <= probability <= 1.0
            assert abs(turn * probability - float(exact[node])) < 1e-9
            turn *= 1.0 - probability
