"""End to end: tree speculative sampling reproduces the target's own sampling distribution."""

import pytest
import torch

from moe_spec import SpecDecoder, TreeBudget
from moe_spec.core.sampling import SamplingConfig
from moe_spec.testing.helpers import assert_follows, exact_distribution_of_tokens_2_and_3
from moe_spec.testing.tiny_models import tiny_model
from moe_spec.core.tree import DraftTree

VOCAB = 6
PROMPT = [1, 4, 2, 5]


class FullTreeDrafter:
    """Drafts every token at depth 1 and the two lowest ids below each: a tree with many siblings."""

    default_budget = TreeBudget(max_nodes=VOCAB * 3, max_depth=2, branching=VOCAB)

    def begin(self, prompt, features):
        pass

    def commit(self, tokens, features):
        pass

    def propose(self, root_token, budget, sampling):
        tokens, parents = [root_token], [-1]
        for first in range(VOCAB):
            tokens.append(first)
            parents.append(0)
            parent = len(tokens) - 1
            if budget.max_depth >= 2:
                for second in (0, 1):
                    tokens.append(second)
                    parents.append(parent)
        tree = DraftTree.from_lists(tokens, parents)
        # within the budget asked for: a prefix in node order (depth-first here) keeps every parent
        return tree if tree.num_drafted <= budget.max_nodes else tree.subtree(list(range(budget.max_nodes + 1)))


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize(
    "config", [SamplingConfig(1.0), SamplingConfig(0.9, top_k=4), SamplingConfig(1.0, top_p=0.8)], ids=["t1", "topk", "topp"]
)
def test_tokens_sampled_through_sibling_trees_follow_the_target(arch, config):
    model = tiny_model(arch, vocab_size=VOCAB, seed=4)
    # 4 new tokens: the first comes from prefill, the 2nd and 3rd from the first tree step when accepted
    decoder = SpecDecoder(model, drafter=FullTreeDrafter())
    generator = torch.Generator().manual_seed(2024)
    samples = 1500
    counts = torch.zeros(VOCAB, VOCAB)
    tree_steps_accepting_two = 0
    for _ in range(samples):
        result = decoder.generate(
            torch.tensor([PROMPT]), max_new_tokens=4, temperature=config.temperature, top_k=config.top_k,
            top_p=config.top_p, eos_token_id=[], generator=generator,
        )
        first_step = result.stats.steps[0]
        assert first_step.tree_size == VOCAB * 3, "the step verified the whole sibling tree"
        tree_steps_accepting_two += first_step.accepted_length >= 2
        _x1, x2, x3, _x4 = result.sequences[0, len(PROMPT):].tolist()
        counts[x2, x3] += 1
    assert tree_steps_accepting_two > samples // 2
    assert_follows(counts, exact_distribution_of_tokens_2_and_3(model, PROMPT, VOCAB, config))


@pytest.mark.parametrize("policy", ["static", "moe-aware"])
def test_sampling_stays_exact_under_controller_policies(policy):
    from moe_spec.policy.static import StaticController
    from moe_spec.policy.moe_aware import MoeAwareController
    from moe_spec.drafters.lookup import LookupDrafter
    from moe_spec.measure.latency import TimingConfig
    from moe_spec.measure.profiler import ProfileSettings, build_profile
    from moe_spec.core.target import TargetModel

    model = tiny_model("qwen3_moe", vocab_size=VOCAB, seed=4)
    target = TargetModel(model)
    if policy == "static":
        controller = StaticController(TreeBudget(5, 2, VOCAB))
    else:
        settings = ProfileSettings(max_new_tokens=12, prefix_len=8, grid_tokens=(1, 4), grid_experts=(2, 4),
                                   natural_trees=4, curve_sizes=(1, 2, 4), timing=TimingConfig(2, 1, 0))
        profile = build_profile(target, LookupDrafter(), [torch.tensor(PROMPT * 3), torch.tensor(PROMPT[::-1] * 3)], settings)
        controller = MoeAwareController(profile, adapt=False)
    decoder = SpecDecoder(target, drafter=FullTreeDrafter(), controller=controller)
    config = SamplingConfig(1.0)
    generator = torch.Generator().manual_seed(7)
    samples = 1500
    counts = torch.zeros(VOCAB, VOCAB)
    for _ in range(samples):
        result = decoder.generate(torch.tensor([PROMPT]), max_new_tokens=4, temperature=1.0, eos_token_id=[],
                                  generator=generator)
        _x1, x2, x3, _x4 = result.sequences[0, len(PROMPT):].tolist()
        counts[x2, x3] += 1
    assert_follows(counts, exact_distribution_of_tokens_2_and_3(model, PROMPT, VOCAB, config))


def test_sampling_in_a_batch_keeps_each_rows_distribution():
    """Row 0 shares its verify passes with a shorter, left-padded row 1 and must not notice."""

    class SpawningFullTreeDrafter(FullTreeDrafter):
        def spawn(self):
            return SpawningFullTreeDrafter()

    model = tiny_model("qwen3_moe", vocab_size=VOCAB, seed=4)
    decoder = SpecDecoder(model, drafter=SpawningFullTreeDrafter())
    ids = torch.tensor([PROMPT, [0, 0, 2, 5]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    generator = torch.Generator().manual_seed(11)
    samples = 1500
    counts = torch.zeros(VOCAB, VOCAB)
    for _ in range(samples):
        result = decoder.generate(ids, attention_mask=mask, max_new_tokens=4, temperature=1.0, eos_token_id=[],
                                  generator=generator)
        _x1, x2, x3, _x4 = result.sequences[0, len(PROMPT):].tolist()
        counts[x2, x3] += 1
    assert_follows(counts, exact_distribution_of_tokens_2_and_3(model, PROMPT, VOCAB, SamplingConfig(1.0)))


def test_batched_eagle_drafts_keep_each_rows_distribution():
    """The EAGLE head drafting both rows in one batched forward per depth, with siblings and depth 2."""
    from moe_spec.drafters.eagle import EagleDrafter
    from moe_spec.drafters.eagle_config import config_for_target
    from moe_spec.drafters.eagle_head import EagleHead
    from moe_spec.core.target import TargetModel

    model = tiny_model("qwen3_moe", vocab_size=VOCAB, seed=4)
    target = TargetModel(model)
    torch.manual_seed(0)
    head = EagleHead(config_for_target(target, draft_vocab_size=VOCAB), torch.randperm(VOCAB)).eval()
    decoder = SpecDecoder(target, drafter=EagleDrafter(head, target, TreeBudget(8, 2, 3)))
    ids = torch.tensor([PROMPT, [0, 0, 2, 5]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    generator = torch.Generator().manual_seed(13)
    counts = torch.zeros(VOCAB, VOCAB)
    for _ in range(1500):
        result = decoder.generate(ids, attention_mask=mask, max_new_tokens=4, temperature=1.0, eos_token_id=[],
                                  generator=generator)
        _x1, x2, x3, _x4 = result.sequences[0, len(PROMPT):].tolist()
        counts[x2, x3] += 1
    assert sum(s.tree_size for s in result.stats.steps) > 0
    assert_follows(counts, exact_distribution_of_tokens_2_and_3(model, PROMPT, VOCAB, SamplingConfig(1.0)))
