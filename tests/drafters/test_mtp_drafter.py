"""The target's own MTP layers drafting trees (`MtpDrafter`), checked against transformers' MTP code
(`MtpModel.forward`, `MTPCandidateGenerator` inside `generate(use_mtp=True)`) on tiny DeepSeek-V3
and GLM-4-MoE checkpoints written with MTP layers in the published layout; lossless greedy and
sampled, one row and batches."""

import pytest
import torch
from transformers.cache_utils import MtpCache
from transformers.generation import candidate_generator

from moe_spec import SpecDecoder, TreeBudget
from moe_spec.core.sampling import SamplingConfig
from moe_spec.core.target import TargetModel
from moe_spec.drafters.mtp import MtpDrafter
from moe_spec.drafters.mtp_layers import load_mtp_layers, mtp_loading_patterns
from moe_spec.errors import InputError
from moe_spec.core.inputs import left_pad
from moe_spec.policy.static import StaticController
from moe_spec.testing.helpers import (
    PLAIN_PROMPT, REPETITIVE_PROMPT, assert_follows, exact_distribution_of_tokens_2_and_3, hf_greedy, random_prompt,
    target_features,
)
from moe_spec.testing.tiny_models import MTP_ARCHITECTURES, tiny_model, tiny_mtp_checkpoint

GREEDY = SamplingConfig()


@pytest.fixture(scope="module", params=[(arch, layers) for arch in MTP_ARCHITECTURES for layers in (1, 2)],
                ids=lambda p: f"{p[0]}-{p[1]}mtp")
def checkpoint(request, tmp_path_factory):
    arch, layers = request.param
    model = tiny_mtp_checkpoint(arch, tmp_path_factory.mktemp(f"{arch}{layers}"), layers)
    return model, layers


def _chain(model, layers: int, prompt: torch.Tensor, root: int) -> list[int]:
    target = TargetModel(model)
    drafter = MtpDrafter(load_mtp_layers(model), target)
    drafter.begin([prompt], [target_features(target, prompt)])
    tree = drafter.propose([root], TreeBudget(layers, layers, 1), [layers], GREEDY)[0]
    assert tree.depths.tolist() == list(range(layers + 1)), "a chain"
    return tree.tokens[1:].tolist()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_chain_is_what_transformers_mtp_forward_drafts(checkpoint, seed):
    model, layers = checkpoint
    prompt = random_prompt(12, seed=seed)
    with torch.no_grad():
        out = model(prompt[None], output_hidden_states=True)
        root = out.logits[0, -1].argmax()
        mtp = load_mtp_layers(model)
        # transformers' own drafting loop at prefill: inputs shifted by one token, the root appended
        candidates, _, _ = mtp(input_ids=torch.cat([prompt[1:], root[None]])[None], last_hidden_states=out.hidden_states[-1],
                               attention_mask=None, position_ids=torch.arange(1, len(prompt) + 1)[None],
                               mtp_cache=MtpCache(config=model.config.get_mtp_config()))
    assert _chain(model, layers, prompt, int(root)) == candidates[0].tolist()


def test_every_step_drafts_the_candidates_of_transformers_generate(checkpoint, monkeypatch):
    """Greedy `generate(use_mtp=True)` and moe_spec with chains of the layer count: the same candidates
    at every step (the same committed tokens, so the same acceptance), and the same output."""
    model, layers = checkpoint
    prompt = torch.tensor([PLAIN_PROMPT])
    seen = []
    original = candidate_generator.MTPCandidateGenerator.get_candidates

    def recording(self, input_ids, *args, **kwargs):
        ids, logits = original(self, input_ids, *args, **kwargs)
        if ids.shape[1] > input_ids.shape[1]:
            seen.append(ids[0, input_ids.shape[1]:].tolist())
        return ids, logits

    monkeypatch.setattr(candidate_generator.MTPCandidateGenerator, "get_candidates", recording)
    monkeypatch.setattr(model, "_keys_to_ignore_on_load_unexpected", mtp_loading_patterns(model), raising=False)
    new = 20
    expected = model.generate(prompt, use_mtp=True, do_sample=False, max_new_tokens=new, eos_token_id=None,
                              pad_token_id=0)
    target = TargetModel(model)
    drafter = MtpDrafter(load_mtp_layers(model), target)
    proposed = []
    propose = drafter.propose

    def keeping(*args, **kwargs):
        trees = propose(*args, **kwargs)
        proposed.append(trees[0].tokens[1:].tolist())
        return trees

    drafter.propose = keeping
    result = SpecDecoder(target, drafter, StaticController(TreeBudget(layers, layers, 1))).generate(
        prompt, max_new_tokens=new, eos_token_id=[])
    assert torch.equal(result.sequences, expected)
    steps = min(len(seen), len(proposed)) - 1  # the last step may be cut short by the length limit
    assert steps >= 4 and seen[:steps] == proposed[:steps]


@pytest.mark.parametrize("budget", [TreeBudget(60, 5, 10), TreeBudget(8, 4, 2), TreeBudget(3, 3, 1)])
def test_trees_are_lossless(checkpoint, budget):
    model, _ = checkpoint
    target = TargetModel(model)
    decoder = SpecDecoder(target, MtpDrafter(load_mtp_layers(model), target), StaticController(budget))
    for prompt in (REPETITIVE_PROMPT, PLAIN_PROMPT):
        result = decoder.generate(torch.tensor([prompt]), max_new_tokens=24)
        assert torch.equal(result.sequences, hf_greedy(model, prompt, 24))
        assert any(step.tree_size > 1 for step in result.stats.steps)


def test_a_batch_decodes_each_row_as_alone(checkpoint):
    model, _ = checkpoint
    target = TargetModel(model)
    decoder = SpecDecoder(target, MtpDrafter(load_mtp_layers(model), target), StaticController(TreeBudget(12, 4, 3)))
    prompts = [torch.tensor([REPETITIVE_PROMPT]), torch.tensor([PLAIN_PROMPT]), random_prompt(5, seed=3)[None]]
    ids, mask = left_pad(prompts, 0)
    result = decoder.generate(ids, attention_mask=mask, max_new_tokens=16, eos_token_id=[])
    for row, prompt in enumerate(prompts):
        alone = SpecDecoder(target).generate(prompt, max_new_tokens=16, eos_token_id=[]).sequences[0, prompt.shape[1]:]
        assert torch.equal(result.sequences[row, ids.shape[1]:], alone), f"row {row}"


@pytest.mark.parametrize("arch", MTP_ARCHITECTURES)
def test_sampled_trees_follow_the_target(arch, tmp_path):
    vocab, prompt = 6, [1, 4, 2, 5]
    model = tiny_mtp_checkpoint(arch, tmp_path, 1, seed=4, vocab_size=vocab)
    target = TargetModel(model)
    config = SamplingConfig(1.0)
    decoder = SpecDecoder(target, MtpDrafter(load_mtp_layers(model), target),
                          StaticController(TreeBudget(6, 2, 3, sampled=True)))
    generator = torch.Generator().manual_seed(7)
    counts = torch.zeros(vocab, vocab)
    for _ in range(1200):
        result = decoder.generate(torch.tensor([prompt]), max_new_tokens=3, temperature=1.0, eos_token_id=[],
                                  generator=generator)
        x2, x3 = result.sequences[0, len(prompt) + 1:].tolist()
        counts[x2, x3] += 1
    assert_follows(counts, exact_distribution_of_tokens_2_and_3(model, prompt, vocab, config))


def test_a_target_without_mtp_layers_is_a_clear_error(tmp_path):
    model = tiny_model("qwen3_moe")
    with pytest.raises(InputError, match="no MTP layers"):
        load_mtp_layers(model)
    declared = tiny_model("deepseek_v3", num_nextn_predict_layers=1)  # the config says one, the weights are not saved
    declared.save_pretrained(tmp_path)
    declared.config._name_or_path = str(tmp_path)
    with pytest.raises(InputError, match=r"model\.layers\.2\.\*"):
        load_mtp_layers(declared)


def test_the_mtp_layers_experts_are_offloaded_with_the_targets(tmp_path):
    from moe_spec.offload.offloaded_experts import OffloadConfig, offload_experts

    model = tiny_mtp_checkpoint("deepseek_v3", tmp_path / "ckpt", 1)
    expected = [hf_greedy(model, prompt, 20) for prompt in (REPETITIVE_PROMPT, PLAIN_PROMPT)]
    offload = offload_experts(model, OffloadConfig(tmp_path / "store", tier="disk", resident=2))
    try:
        target = TargetModel(model, offload=offload)
        drafter = MtpDrafter.from_target(target)
        assert drafter.offload is not None and (tmp_path / "store" / "mtp_layers").is_dir()
        decoder = SpecDecoder(target, drafter, StaticController(TreeBudget(8, 4, 2)))
        for prompt, reference in zip((REPETITIVE_PROMPT, PLAIN_PROMPT), expected):
            result = decoder.generate(torch.tensor([prompt]), max_new_tokens=20)
            assert torch.equal(result.sequences, reference)
            assert sum(step.expert_misses for step in result.stats.steps) > 0, "the target's experts were read"
        assert drafter.offload.counters.misses > 0, "the MTP layer's experts were read from disk too"
    finally:
        offload.close()
        if drafter.offload is not None:
            drafter.offload.close()


def test_a_checkpoint_saved_again_into_its_folder_gets_its_mtp_layers_again(tmp_path):
    """save_pretrained over a folder that already holds shards and an index writes a single file,
    which loaders read first: adding the MTP layers again must go by that file, not the stale index."""
    first = tiny_mtp_checkpoint("deepseek_v3", tmp_path, 1)
    again = tiny_mtp_checkpoint("deepseek_v3", tmp_path, 1)
    assert not (tmp_path / "model.safetensors").exists()
    assert torch.equal(load_mtp_layers(first).layers[0].eh_proj.weight, load_mtp_layers(again).layers[0].eh_proj.weight)
