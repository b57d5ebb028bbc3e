"""`moe_spec.decoder`: the Python API's default method is the best one this target and machine allow."""

import pytest
import torch

import moe_spec
from moe_spec.core.target import TargetModel
from moe_spec.loading import load_target
from moe_spec.policy.bounded_controller import BoundedController
from moe_spec.policy.moe_aware import MoeAwareController
from moe_spec.policy.static import StaticController
from moe_spec.testing.helpers import REPETITIVE_PROMPT
from moe_spec.testing.tiny_models import tiny_model


def test_without_a_profile_it_drafts_the_best_fixed_tree_and_says_so():
    model = tiny_model("qwen3_moe")
    with pytest.warns(UserWarning, match="no profile= of this target, so drafting static:4"):
        decoder = moe_spec.decoder(model, drafter="lookup")
    assert isinstance(decoder.controller, StaticController) and decoder.controller.budget.max_nodes == 4
    prompt = torch.tensor([REPETITIVE_PROMPT])
    result = decoder.generate(prompt, max_new_tokens=12)
    assert torch.equal(result.sequences, model.generate(prompt, do_sample=False, max_new_tokens=12))


def test_the_embedded_pair_decodes_with_moe_aware_on_its_shipped_profile():
    target = TargetModel(load_target())
    decoder = moe_spec.decoder(target, drafter="default")
    assert isinstance(decoder.controller, BoundedController)
    assert isinstance(decoder.controller.sizing, MoeAwareController)
    prompt = torch.tensor([REPETITIVE_PROMPT])
    result = decoder.generate(prompt, max_new_tokens=16)
    reference = target.model.generate(prompt, do_sample=False, max_new_tokens=16, eos_token_id=[], pad_token_id=0)
    assert torch.equal(result.sequences, reference[:, : result.sequences.shape[1]])


def test_a_named_method_and_plain_decoding():
    model = tiny_model("mixtral")
    assert moe_spec.decoder(model, drafter=None).controller is None
    decoder = moe_spec.decoder(model, drafter="lookup", method="eagle2")
    assert isinstance(decoder.controller, StaticController) and decoder.controller.budget.max_nodes == 60
