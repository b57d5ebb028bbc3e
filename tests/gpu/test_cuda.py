"""The same decoding on CUDA: greedy identity with transformers and the sampling distribution,
for three architectures (a sliding-window eager one among them).

Each test takes the device as a parameter: "cpu" runs in the normal suite (the sampling one is
slow), "cuda" carries the `gpu` marker (deselected by default; `pytest -m gpu tests/gpu`) and is
skipped without CUDA, unless MOE_SPEC_REQUIRE_CUDA=1 (as `scripts/gpu_check.sh` sets on a device),
which turns a missing CUDA into a failure rather than a silent skip.
"""

import os

import pytest
import torch

from moe_spec import LookupDrafter, SpecDecoder, TreeBudget
from moe_spec.core.sampling import SamplingConfig
from moe_spec.core.target import TargetModel
from moe_spec.drafters.eagle import EagleDrafter
from moe_spec.testing.helpers import (
    PLAIN_PROMPT, REPETITIVE_PROMPT, assert_follows, exact_distribution_of_tokens_2_and_3, hf_greedy, random_eagle_head,
)
from moe_spec.testing.tiny_models import tiny_model

ARCHITECTURES = ("qwen3_moe", "mixtral", "gpt_oss")
REQUIRE_CUDA = os.environ.get("MOE_SPEC_REQUIRE_CUDA") == "1"
CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() and not REQUIRE_CUDA, reason="needs a CUDA device")])
DEVICES = ("cpu", CUDA)
NEW_TOKENS = 24
VOCAB = 6
PROMPT = [1, 4, 2, 5]
SAMPLES = 1000  # fewer than tests/core's 1500, to fit the device check; the chi-square bound holds at any size


def _on(device: str, model):
    if device == "cuda":
        assert torch.cuda.is_available(), "MOE_SPEC_REQUIRE_CUDA=1 but torch sees no CUDA device"
    return model.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_tree_decoding_equals_hf_greedy_on_the_device(arch, device):
    model = _on(device, tiny_model(arch))
    target = TargetModel(model)
    drafters = {"lookup": LookupDrafter(), "eagle": EagleDrafter(random_eagle_head(target), target, TreeBudget(12, 4, 3))}
    for name, drafter in drafters.items():
        decoder = SpecDecoder(target, drafter=drafter)
        for prompt in (REPETITIVE_PROMPT, PLAIN_PROMPT):
            expected = hf_greedy(model, prompt, NEW_TOKENS)
            result = decoder.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS)
            assert torch.equal(result.sequences, expected), f"{arch} on {device}, {name} drafter, prompt {prompt[:4]}..."
            assert sum(s.tree_size for s in result.stats.steps) > 0, "trees were verified"


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.slow), CUDA])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_tokens_sampled_through_eagle_trees_follow_the_target_on_the_device(arch, device):
    """Two rows (one left-padded) drafted by an EAGLE head on the device, sampled with the caller's
    CPU generator: row 0's 2nd and 3rd tokens follow the target's own distribution."""
    model = _on(device, tiny_model(arch, vocab_size=VOCAB, seed=4))
    target = TargetModel(model)
    decoder = SpecDecoder(target, drafter=EagleDrafter(random_eagle_head(target, draft_vocab=VOCAB), target,
                                                       TreeBudget(8, 2, 3)))
    config = SamplingConfig(1.0)
    ids = torch.tensor([PROMPT, [0, 0, 2, 5]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    generator = torch.Generator().manual_seed(13)
    counts = torch.zeros(VOCAB, VOCAB)
    drafted = 0
    for _ in range(SAMPLES):
        result = decoder.generate(ids, attention_mask=mask, max_new_tokens=4, temperature=1.0, eos_token_id=[],
                                  generator=generator)
        _x1, x2, x3, _x4 = result.sequences[0, len(PROMPT):].tolist()
        counts[x2, x3] += 1
        drafted += sum(s.tree_size for s in result.stats.steps)
    assert drafted > 0
    assert_follows(counts, exact_distribution_of_tokens_2_and_3(model, PROMPT, VOCAB, config))
