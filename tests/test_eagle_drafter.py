"""EagleDrafter / EagleHead on tiny random targets: trees, cache handling, train/draft consistency, loading."""

from __future__ import annotations

import pytest
import torch

from moe_spec.drafters.base import TreeBudget
from moe_spec.drafters.eagle import EagleDrafter
from moe_spec.drafters.eagle_head import DraftHeadMismatchError, EagleHead, config_for_target
from moe_spec.engine import SpecDecoder
from moe_spec.errors import MoeSpecError
from moe_spec.sampling import SamplingConfig
from moe_spec.target import TargetModel
from moe_spec.tiny_models import tiny_model

torch.set_num_threads(1)
DRAFT_VOCAB = 64


def _random_head(target: TargetModel, seed: int = 0) -> EagleHead:
    torch.manual_seed(seed)
    d2t = torch.randperm(target.vocab_size)[:DRAFT_VOCAB]
    head = EagleHead(config_for_target(target, draft_vocab_size=DRAFT_VOCAB), d2t)
    with torch.no_grad():  # a decisive random head, so trees are not near-uniform
        head.lm_head.weight.normal_(0.0, 0.5)
    return head.eval()


@pytest.fixture(scope="module")
def qwen():
    target = TargetModel(tiny_model("qwen3_moe"))
    return target, _random_head(target)


def _prompt(n: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(seed))


def _begun(target: TargetModel, head: EagleHead, prompt: torch.Tensor) -> EagleDrafter:
    """A drafter begun on `prompt` minus its last token (the pending root), as the engine does."""
    drafter = EagleDrafter(head, target)
    prefix = prompt[:-1]
    features = target.model(prefix[None], output_hidden_states=True).hidden_states
    drafter.begin(prefix, torch.stack([features[i][0] for i in target.feature_layers], dim=1).detach())
    return drafter


def _check_tree(tree, root: int, budget: TreeBudget, head: EagleHead, vocab: int) -> None:
    assert int(tree.tokens[0]) == root and int(tree.parents[0]) == -1
    assert tree.num_drafted <= budget.max_nodes
    assert int(tree.depths.max()) <= budget.max_depth
    parents = tree.parents[1:]
    assert bool((parents < torch.arange(1, len(tree))).all())  # topological, connected
    assert bool((tree.scores[1:] <= tree.scores[parents] + 1e-6).all())  # non-increasing along paths
    assert bool(torch.isfinite(tree.scores).all())
    drafted = tree.tokens[1:]
    assert bool(((drafted >= 0) & (drafted < vocab)).all())
    assert bool(torch.isin(drafted, head.draft_to_target).all())
    for node in range(len(tree)):  # siblings are distinct tokens, at most `branching` of them
        children = tree.tokens[tree.parents == node]
        assert children.numel() <= budget.branching and children.unique().numel() == children.numel()


@pytest.mark.parametrize("budget", [TreeBudget(60, 5, 10), TreeBudget(7, 3, 4), TreeBudget(1, 1, 1), TreeBudget(5, 8, 2)])
@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(1.0), SamplingConfig(0.7, top_k=5, top_p=0.9)])
def test_tree_invariants(qwen, budget, sampling):
    target, head = qwen
    prompt = _prompt()
    tree = _begun(target, head, prompt).propose(int(prompt[-1]), budget, sampling)
    _check_tree(tree, int(prompt[-1]), budget, head, target.vocab_size)
    assert tree.num_drafted == min(budget.max_nodes, _candidates(budget)) or not sampling.greedy


def _candidates(budget: TreeBudget) -> int:
    depth = min(budget.max_depth, budget.max_nodes)
    return budget.branching + (depth - 1) * budget.branching**2


def test_small_budget_keeps_the_globally_best_nodes(qwen):
    target, head = qwen
    prompt = _prompt()
    drafter = _begun(target, head, prompt)
    big = drafter.propose(int(prompt[-1]), TreeBudget(60, 4, 6), SamplingConfig())
    small = drafter.propose(int(prompt[-1]), TreeBudget(12, 4, 6), SamplingConfig())
    assert torch.allclose(small.scores[1:].sort(descending=True).values, big.scores[1:].sort(descending=True).values[:12])
    assert small.num_drafted == 12


def test_sampling_scores_follow_the_sampled_distribution(qwen):
    target, head = qwen
    prompt = _prompt()
    tree = _begun(target, head, prompt).propose(int(prompt[-1]), TreeBudget(60, 3, 10), SamplingConfig(1.0, top_k=3))
    root_children = tree.scores[tree.parents == 0]
    assert root_children.numel() == 3  # tokens outside the top-3 have zero draft probability
    assert torch.logsumexp(root_children, 0).abs() < 1e-4  # they carry the whole sampled distribution


def test_incremental_drafting_equals_drafting_from_scratch(qwen):
    """The head's cache after several propose/commit rounds holds exactly the committed pairs."""
    target, head = qwen
    drafter = EagleDrafter(head, target)
    prompt = _prompt(10, seed=1)
    out = SpecDecoder(target, drafter=drafter).generate(prompt[None], max_new_tokens=24, eos_token_id=[])
    sequence = out.sequences[0]
    budget = TreeBudget(20, 4, 4)
    continued = drafter.propose(int(sequence[-1]), budget, SamplingConfig())
    fresh = _begun(target, head, sequence).propose(int(sequence[-1]), budget, SamplingConfig())
    assert torch.equal(continued.tokens, fresh.tokens) and torch.equal(continued.parents, fresh.parents)
    assert torch.allclose(continued.scores, fresh.scores, atol=1e-4)


def test_chain_drafts_follow_the_training_unroll(qwen):
    """Depth k+1 of a draft is pass k of `EagleHead.unroll` (the training-time test) on the same tokens."""
    target, head = qwen
    prompt = _prompt(9, seed=2)
    chain = _begun(target, head, prompt).propose(int(prompt[-1]), TreeBudget(3, 3, 1), SamplingConfig())
    assert chain.num_drafted == 3 and chain.depths.tolist() == [0, 1, 2, 3]
    tokens = torch.cat([prompt, chain.tokens[1:]])  # prompt (root last) + drafts
    with torch.no_grad():
        hidden = target.model(prompt[None, :-1], output_hidden_states=True).hidden_states
        features = torch.stack([hidden[i][0] for i in target.feature_layers], dim=1)  # [P-1, S, D]
        features = torch.cat([features, torch.zeros(4, *features.shape[1:])])  # unknown past the root: unused
        embeds = target.model.get_input_embeddings()(tokens)
        passes = [head.logits(h[0]) for h in head.unroll(features[None], embeds[None], steps=3)]
    root_pair = len(prompt) - 2  # pair (features of the last committed position, root)
    cumulative = 0.0
    for k, logits in enumerate(passes):
        logp = torch.log_softmax(logits[root_pair + k], -1)
        assert int(head.draft_to_target[logp.argmax()]) == int(chain.tokens[k + 1])
        cumulative += float(logp.max())
        assert abs(cumulative - float(chain.scores[k + 1])) < 1e-4


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss", "deepseek_v3", "mixtral"])
def test_greedy_matches_generate_with_a_random_head(model_type):
    model = tiny_model(model_type)
    target = TargetModel(model)
    prompt = _prompt(11, seed=3)[None]
    out = SpecDecoder(target, drafter=EagleDrafter(_random_head(target), target)).generate(
        prompt, max_new_tokens=30, eos_token_id=[])
    reference = model.generate(prompt, do_sample=False, max_new_tokens=30, min_new_tokens=30, eos_token_id=[],
                               pad_token_id=0)
    assert torch.equal(out.sequences, reference)
    assert all(step.tree_size <= 60 for step in out.stats.steps)


def test_save_and_reload_round_trip(qwen, tmp_path):
    target, head = qwen
    EagleDrafter(head, target).save_pretrained(tmp_path)
    loaded = EagleDrafter.from_pretrained(tmp_path, target)
    assert loaded.head.config == head.config
    assert torch.equal(loaded.head.draft_to_target, head.draft_to_target)
    assert torch.equal(loaded.head.fc.weight, head.fc.weight.to(torch.bfloat16).float())
    assert loaded.default_budget == TreeBudget(60, 5, 10)


@pytest.mark.parametrize(
    "other, named",
    [
        (dict(model_type="deepseek_v3"), "model_type"),
        (dict(model_type="qwen3_moe", vocab_size=128), "vocab_size"),
        (dict(model_type="qwen3_moe", hidden_size=64, head_dim=16), "hidden_size"),
        (dict(model_type="qwen3_moe", num_hidden_layers=4), "num_hidden_layers"),
    ],
)
def test_loading_against_another_target_names_the_mismatch(qwen, tmp_path, other, named):
    target, head = qwen
    head.save_pretrained(tmp_path)
    overrides = {k: v for k, v in other.items() if k != "model_type"}
    other_target = TargetModel(tiny_model(other["model_type"], **overrides))
    with pytest.raises(DraftHeadMismatchError, match=named) as info:
        EagleDrafter.from_pretrained(tmp_path, other_target)
    assert isinstance(info.value, MoeSpecError)


def test_other_feature_layers_are_a_mismatch(qwen, tmp_path):
    target, head = qwen
    head.save_pretrained(tmp_path)
    with pytest.raises(DraftHeadMismatchError, match="feature_layers"):
        EagleDrafter.from_pretrained(tmp_path, TargetModel(target.model, feature_layers=(0, 2)))


def test_loading_a_folder_without_a_head_is_a_clear_error(qwen, tmp_path):
    with pytest.raises(MoeSpecError, match="config.json"):
        EagleDrafter.from_pretrained(tmp_path, qwen[0])
