"""A small causal LM drafting trees for the target (`DraftModelDrafter`): its chains are the
candidates of transformers' `AssistedCandidateGenerator` (`generate(assistant_model=...)`), decoding
is lossless greedy, in batches and sampled; a draft model of another vocabulary is refused."""

import pytest
import torch
from transformers.generation import candidate_generator

from moe_spec import SpecDecoder, TreeBudget
from moe_spec.core.sampling import SamplingConfig
from moe_spec.core.target import TargetModel
from moe_spec.drafters.draft_model import DraftModelDrafter
from moe_spec.errors import InputError
from moe_spec.core.inputs import left_pad
from moe_spec.policy.static import StaticController
from moe_spec.testing.helpers import (
    ALL_ARCHITECTURES, PLAIN_PROMPT, REPETITIVE_PROMPT, assert_follows, exact_distribution_of_tokens_2_and_3, hf_greedy,
    random_prompt,
)
from moe_spec.testing.tiny_models import tiny_model


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3", "gpt_oss"])
def pair(request):
    """A tiny MoE target and a tiny dense draft model of the same vocabulary."""
    return tiny_model(request.param), tiny_model("llama", seed=3, num_hidden_layers=1)


@pytest.mark.parametrize("chain", [1, 3])
def test_every_step_drafts_the_candidates_of_transformers_assisted_generation(pair, chain, monkeypatch):
    target_model, draft = pair
    if target_model.config.model_type == "gpt_oss":
        # there transformers' assistant drafts, at one step of 17, a chain that is not the draft model's
        # own greedy continuation of the prefix (checked with draft.generate); moe_spec's is (next test)
        pytest.skip("transformers' assisted candidates drift from the draft model's greedy chain on this target")
    seen = []
    original = candidate_generator.AssistedCandidateGenerator.get_candidates

    def recording(self, input_ids, *args, **kwargs):
        ids, logits = original(self, input_ids, *args, **kwargs)
        seen.append((input_ids.shape[1], ids[0, input_ids.shape[1]:].tolist()))  # (first candidate's position, candidates)
        return ids, logits

    monkeypatch.setattr(candidate_generator.AssistedCandidateGenerator, "get_candidates", recording)
    draft.generation_config.num_assistant_tokens = chain
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0
    prompt = torch.tensor([REPETITIVE_PROMPT])
    new = 20
    expected = target_model.generate(prompt, attention_mask=torch.ones_like(prompt), assistant_model=draft,
                                      do_sample=False, max_new_tokens=new, eos_token_id=None, pad_token_id=0)
    target = TargetModel(target_model)
    drafter = DraftModelDrafter(draft, target)
    proposed = []
    propose = drafter.propose

    def keeping(*args, **kwargs):
        trees = propose(*args, **kwargs)
        # the root pair sits at column `lengths` (its token at position lengths + 1): candidates start one later
        proposed.append((drafter._runner.lengths[0] + 2, trees[0].tokens[1:].tolist()))
        return trees

    drafter.propose = keeping
    result = SpecDecoder(target, drafter, StaticController(TreeBudget(chain, chain, 1))).generate(
        prompt, max_new_tokens=new, eos_token_id=[])
    assert torch.equal(result.sequences, expected)
    # both decode the same tokens, but transformers drafts before its first forward (the prompt's next
    # token) and moe_spec after prefill, so their steps start at different positions: compare the
    # candidates drafted after the same prefix, all but the last (cut short by the length limit)
    theirs, ours = dict(seen[:-1]), dict(proposed[:-1])
    shared = sorted(set(theirs) & set(ours))
    assert len(shared) >= 3 and [theirs[p] for p in shared] == [ours[p] for p in shared]


def test_every_chain_is_the_draft_models_own_greedy_continuation(pair):
    target_model, draft = pair
    target = TargetModel(target_model)
    drafter = DraftModelDrafter(draft, target)
    chains = []
    propose = drafter.propose

    def keeping(*args, **kwargs):
        trees = propose(*args, **kwargs)
        chains.append((drafter._runner.lengths[0] + 2, trees[0].tokens[1:].tolist()))
        return trees

    drafter.propose = keeping
    prompt = torch.tensor([REPETITIVE_PROMPT])
    sequence = SpecDecoder(target, drafter, StaticController(TreeBudget(3, 3, 1))).generate(
        prompt, max_new_tokens=20, eos_token_id=[]).sequences
    for start, chain in chains:
        context = sequence[:, :start]
        own = draft.generate(context, attention_mask=torch.ones_like(context), do_sample=False, max_new_tokens=3,
                             eos_token_id=None, pad_token_id=0)[0, start:].tolist()
        assert chain and chain == own[:len(chain)], f"candidates from position {start}"  # the last steps draft fewer


@pytest.mark.parametrize("budget", [TreeBudget(60, 5, 10), TreeBudget(8, 4, 2)])
def test_trees_are_lossless(pair, budget):
    target_model, draft = pair
    target = TargetModel(target_model)
    decoder = SpecDecoder(target, DraftModelDrafter(draft, target), StaticController(budget))
    for prompt in (REPETITIVE_PROMPT, PLAIN_PROMPT):
        result = decoder.generate(torch.tensor([prompt]), max_new_tokens=24)
        assert torch.equal(result.sequences, hf_greedy(target_model, prompt, 24))
        assert any(step.tree_size > 1 for step in result.stats.steps)


def test_a_batch_decodes_each_row_as_alone(pair):
    target_model, draft = pair
    target = TargetModel(target_model)
    decoder = SpecDecoder(target, DraftModelDrafter(draft, target), StaticController(TreeBudget(12, 4, 3)))
    prompts = [torch.tensor([REPETITIVE_PROMPT]), torch.tensor([PLAIN_PROMPT]), random_prompt(5, seed=3)[None]]
    ids, mask = left_pad(prompts, 0)
    result = decoder.generate(ids, attention_mask=mask, max_new_tokens=16, eos_token_id=[])
    for row, prompt in enumerate(prompts):
        alone = SpecDecoder(target).generate(prompt, max_new_tokens=16, eos_token_id=[]).sequences[0, prompt.shape[1]:]
        assert torch.equal(result.sequences[row, ids.shape[1]:], alone), f"row {row}"


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "gpt_oss", "glm4_moe"])
def test_sampled_trees_follow_the_target(arch):
    vocab, prompt = 6, [1, 4, 2, 5]
    target_model = tiny_model(arch, vocab_size=vocab, seed=4)
    draft = tiny_model("llama", vocab_size=vocab, seed=5, num_hidden_layers=1)
    target = TargetModel(target_model)
    decoder = SpecDecoder(target, DraftModelDrafter(draft, target), StaticController(TreeBudget(6, 2, 3, sampled=True)))
    generator = torch.Generator().manual_seed(7)
    counts = torch.zeros(vocab, vocab)
    for _ in range(1200):
        result = decoder.generate(torch.tensor([prompt]), max_new_tokens=3, temperature=1.0, eos_token_id=[],
                                  generator=generator)
        x2, x3 = result.sequences[0, len(prompt) + 1:].tolist()
        counts[x2, x3] += 1
    assert_follows(counts, exact_distribution_of_tokens_2_and_3(target_model, prompt, vocab, SamplingConfig(1.0)))


def test_a_draft_model_of_another_vocabulary_is_refused():
    target = TargetModel(tiny_model("qwen3_moe"))
    with pytest.raises(InputError, match=r"120 output / 120 input tokens.*96 tokens"):
        DraftModelDrafter(tiny_model("llama", vocab_size=120), target)


@pytest.mark.parametrize("arch", ALL_ARCHITECTURES)
def test_lossless_on_every_architecture_alone_and_in_a_batch(arch):
    target_model = tiny_model(arch)
    target = TargetModel(target_model)
    decoder = SpecDecoder(target, DraftModelDrafter(tiny_model("llama", seed=3, num_hidden_layers=1), target),
                          StaticController(TreeBudget(12, 4, 3)))
    prompts = [torch.tensor([REPETITIVE_PROMPT]), torch.tensor([PLAIN_PROMPT])]
    for prompt in prompts:
        result = decoder.generate(prompt, max_new_tokens=16)
        assert torch.equal(result.sequences, hf_greedy(target_model, prompt[0].tolist(), 16)), arch
    ids, mask = left_pad(prompts, 0)
    batch = decoder.generate(ids, attention_mask=mask, max_new_tokens=16, eos_token_id=[])
    for row, prompt in enumerate(prompts):
        alone = SpecDecoder(target).generate(prompt, max_new_tokens=16, eos_token_id=[]).sequences[0, prompt.shape[1]:]
        assert torch.equal(batch.sequences[row, ids.shape[1]:], alone), f"{arch} row {row}"
