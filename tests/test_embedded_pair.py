"""The shipped default pair: loads with plain transformers, is balanced, and decodes losslessly."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from moe_spec import SpecDecoder
from moe_spec.policy.static import StaticController
from moe_spec.policy.moe_aware import MoeAwareController
from moe_spec.drafters import EagleDrafter, TreeBudget
from moe_spec.loading import DEFAULT_DRAFT_MODEL, DEFAULT_DRAFTER, DEFAULT_TARGET, load_drafter, load_target, load_tokenizer
from moe_spec.profile.artifact import Profile
from moe_spec.measure.store import DEFAULT_PROFILE
from moe_spec.experiments.prompt_file import load_prompts
from moe_spec.core.target import TargetModel

from moe_spec.testing.helpers import hf_greedy


@pytest.fixture(scope="module")
def pair():
    model = load_target()
    target = TargetModel(model)
    return model, target, EagleDrafter.from_pretrained(DEFAULT_DRAFTER, target), load_tokenizer()


def test_plain_from_pretrained_gives_the_balanced_router_bias():
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_TARGET)
    biases = [layer.mlp.gate.e_score_correction_bias for layer in model.model.layers]
    assert all(bias.abs().sum() > 0 for bias in biases), "the balancing bias ships with the weights"
    meta = json.loads((DEFAULT_TARGET / "moe_spec_meta.json").read_text())
    assert meta["bias_restored_by_from_pretrained"] is True


def test_the_shipped_shape_is_a_fine_grained_moe():
    config = json.loads((DEFAULT_TARGET / "config.json").read_text())
    assert config["n_routed_experts"] >= 64 and config["num_experts_per_tok"] >= 4 and config["num_hidden_layers"] >= 8
    meta = json.loads((DEFAULT_TARGET / "moe_spec_meta.json").read_text())
    assert meta["params_experts"] / meta["params_total"] >= 0.8


def test_greedy_identity_with_the_trained_head_on_heldout_prompts(pair):
    model, target, drafter, tokenizer = pair
    prompts = [p for p in load_prompts("configs/bench/smoke.jsonl") if p.prompt_class != "random"][:3]
    for controller in (None, StaticController(TreeBudget(8, 5, 10))):
        decoder = SpecDecoder(target, drafter=drafter, controller=controller)
        for prompt in prompts:
            ids = prompt.input_ids(tokenizer)
            result = decoder.generate(ids, max_new_tokens=24)
            assert torch.equal(result.sequences, hf_greedy(model, ids[0].tolist(), 24))
            assert result.stats.mean_accept_len > 1.0


def test_the_shipped_profile_fits_the_shipped_target_and_drives_moe_aware(pair):
    model, target, drafter, tokenizer = pair
    profile = Profile.load(DEFAULT_PROFILE, target)
    prompt = load_prompts("configs/bench/smoke.jsonl")[0].input_ids(tokenizer)
    result = SpecDecoder(target, drafter=drafter, controller=MoeAwareController(profile)).generate(prompt, max_new_tokens=24)
    assert torch.equal(result.sequences, hf_greedy(model, prompt[0].tolist(), 24))


@pytest.mark.parametrize("name", ["mtp", str(DEFAULT_DRAFT_MODEL)])
def test_the_shipped_mtp_layer_and_draft_model_draft_losslessly_and_are_accepted(pair, name):
    """The embedded target's own MTP layer (in its checkpoint, as transformers finds it) and the small
    draft model shipped beside it, each named as a user names it."""
    model, target, _, tokenizer = pair
    target = TargetModel(model)
    drafter = load_drafter(name, target)
    prompts = [p for p in load_prompts("configs/bench/smoke.jsonl") if p.prompt_class != "random"][:2]
    decoder = SpecDecoder(target, drafter=drafter, controller=StaticController(TreeBudget(8, 5, 10)))
    for prompt in prompts:
        ids = prompt.input_ids(tokenizer)
        result = decoder.generate(ids, max_new_tokens=24)
        assert torch.equal(result.sequences, hf_greedy(model, ids[0].tolist(), 24))
        assert result.stats.mean_accept_len > 1.2, f"{name} is trained: its drafts are accepted"
