"""The whole product on the features real MoE checkpoints have and the plain tiny configs leave off:
dense layers first (DeepSeek-V3 / GLM-4.5), grouped routing and a q LoRA (DeepSeek-V3), dense layers
inside a Qwen MoE stack (`mlp_only_layers`, `decoder_sparse_step`).

Dense layers shift every MoE layer's index away from its decoder layer's, and routing capture, the
profile, the cost model, the controller's pricing and offload all key on those indices."""

import pytest
import torch

from moe_spec.experiments.runner import left_pad
from moe_spec import LookupDrafter, SpecDecoder, TreeBudget
from moe_spec.core.sampling import SamplingConfig
from moe_spec.core.stats import GenerationStats
from moe_spec.core.target import TargetModel
from moe_spec.drafters.eagle import EagleDrafter
from moe_spec.measure.latency import TimingConfig
from moe_spec.measure.profiler import ProfileSettings, build_profile
from moe_spec.offload.offloaded_experts import OffloadConfig, offload_experts
from moe_spec.policy.moe_aware import MoeAwareController
from moe_spec.policy.static import StaticController
from moe_spec.policy.truncate import TruncateController, token_count_cost
from moe_spec.testing.helpers import (
    PLAIN_PROMPT, REPETITIVE_PROMPT, assert_follows, assert_speculated, exact_distribution_of_tokens_2_and_3, hf_greedy,
    random_eagle_head,
)
from moe_spec.testing.tiny_models import REAL_FEATURE_VARIANTS, tiny_variant

VARIANTS = list(REAL_FEATURE_VARIANTS)
MOE_LAYERS = {"deepseek_v3-dense-first-grouped": (2, 3), "qwen3_moe-mlp-only": (1, 2), "qwen2_moe-sparse-step": (1, 3)}
PROMPTS = (REPETITIVE_PROMPT, PLAIN_PROMPT + REPETITIVE_PROMPT)
QUICK = ProfileSettings(
    max_new_tokens=16, prefix_len=16, grid_tokens=(1, 4, 16), grid_experts=(2, 4, 8), natural_trees=6,
    curve_sizes=(1, 2, 4, 8), timing=TimingConfig(repeats=2, warmup=1, evict_mb=0),
)


@pytest.fixture(scope="module", params=VARIANTS)
def profiled(request):
    """A variant, its target and a quick profile of it with the lookup drafter."""
    model = tiny_variant(request.param)
    target = TargetModel(model)
    prompts = [torch.tensor(p) for p in (*PROMPTS, [30, 31, 32, 33] * 4)]
    return request.param, model, target, build_profile(target, LookupDrafter(), prompts, QUICK)


def test_routing_is_captured_at_the_moe_layers_only(profiled):
    name, _, target, profile = profiled
    assert target.moe_layers == MOE_LAYERS[name]
    assert profile.cost_model.num_layers == len(MOE_LAYERS[name])
    assert profile.fingerprint["moe_layers"] == list(MOE_LAYERS[name])
    out = SpecDecoder(target).generate(torch.tensor([PLAIN_PROMPT]), max_new_tokens=4)
    assert all(len(step.unique_experts_per_layer) == len(MOE_LAYERS[name]) for step in out.stats.steps)


@pytest.mark.parametrize("drafter", ["lookup", "eagle"])
def test_every_drafter_and_policy_equals_transformers_greedy(profiled, drafter):
    name, model, target, profile = profiled
    policies = {
        "static:4": StaticController(TreeBudget(4, 8, 4)),
        "truncate": TruncateController(profile, token_count_cost(profile), budget=TreeBudget(16, 8, 4)),
        "moe-aware": MoeAwareController(profile),
    }
    for policy, controller in policies.items():
        source = LookupDrafter() if drafter == "lookup" else EagleDrafter(random_eagle_head(target), target,
                                                                         TreeBudget(12, 4, 3))
        decoder = SpecDecoder(target, drafter=source, controller=controller)
        steps = []
        for prompt in PROMPTS:
            result = decoder.generate(torch.tensor([prompt]), max_new_tokens=24)
            assert torch.equal(result.sequences, hf_greedy(model, prompt, 24)), f"{name} {drafter} {policy}"
            steps += result.stats.steps
        if drafter == "lookup":
            assert_speculated(GenerationStats(steps=steps))


def test_a_ragged_batch_under_moe_aware_decodes_each_row_as_alone(profiled):
    name, model, target, profile = profiled
    rows = [REPETITIVE_PROMPT, PLAIN_PROMPT[:4], PLAIN_PROMPT + REPETITIVE_PROMPT, [7, 7, 7]]
    ids, mask = left_pad([torch.tensor([r]) for r in rows], pad=0)  # [B, width] each
    width = ids.shape[1]
    result = SpecDecoder(target, drafter=LookupDrafter(), controller=MoeAwareController(profile)).generate(
        ids, attention_mask=mask, max_new_tokens=16)
    for row, prompt in enumerate(rows):
        alone = hf_greedy(model, prompt, 16)[0, len(prompt):].tolist()
        assert result.sequences[row, width:].tolist()[: len(alone)] == alone, f"{name} row {row}"
    assert_speculated(result.stats)


def test_offloaded_experts_decode_as_the_resident_model(profiled, tmp_path):
    name, model, _, profile = profiled
    offloaded = tiny_variant(name)
    offload = offload_experts(offloaded, OffloadConfig(tmp_path / "store", tier="disk", resident=2))
    try:
        target = TargetModel(offloaded, offload=offload)
        assert target.moe_layers == MOE_LAYERS[name]
        for controller in (StaticController(TreeBudget(4, 8, 4)), MoeAwareController(profile, residency=offload.residency)):
            decoder = SpecDecoder(target, drafter=LookupDrafter(), controller=controller, offload=offload)
            steps = []
            for prompt in PROMPTS:
                result = decoder.generate(torch.tensor([prompt]), max_new_tokens=24)
                assert torch.equal(result.sequences, hf_greedy(model, prompt, 24)), f"{name} {type(controller).__name__}"
                assert result.stats.misses_per_token > 0
                steps += result.stats.steps
            assert_speculated(GenerationStats(steps=steps))
    finally:
        offload.close()


@pytest.mark.slow
@pytest.mark.parametrize("name", VARIANTS)
def test_tokens_sampled_through_trees_follow_the_target(name):
    """Second and third sampled tokens (after one speculative step) against the exact joint law."""
    vocab = 6
    model = tiny_variant(name, vocab_size=vocab, seed=4)
    target = TargetModel(model)
    decoder = SpecDecoder(target, drafter=EagleDrafter(random_eagle_head(target, draft_vocab=vocab), target,
                                                       TreeBudget(8, 2, 3)))
    prompt = [1, 4, 2, 5]
    generator = torch.Generator().manual_seed(3)
    counts = torch.zeros(vocab, vocab)
    for _ in range(1500):
        result = decoder.generate(torch.tensor([prompt]), max_new_tokens=3, temperature=1.0, eos_token_id=[],
                                  generator=generator)
        _, x2, x3 = result.sequences[0, len(prompt):].tolist()
        counts[x2, x3] += 1
    assert_follows(counts, exact_distribution_of_tokens_2_and_3(model, prompt, vocab, SamplingConfig(1.0)))
