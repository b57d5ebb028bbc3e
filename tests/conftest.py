import os

import pytest
import torch

torch.set_num_threads(int(os.environ.get("MOE_SPEC_TEST_THREADS", "1")))

from moe_spec.tiny_models import DENSE_ARCHITECTURES, MOE_ARCHITECTURES, tiny_model  # noqa: E402

ALL_ARCHITECTURES = MOE_ARCHITECTURES + DENSE_ARCHITECTURES

REPETITIVE_PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]
PLAIN_PROMPT = [11, 42, 7, 63, 20, 3, 88, 15, 31, 54]


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> torch.Tensor:
    """transformers' own greedy decoding; it stops at the model's EOS, as SpecDecoder does by default."""
    ids = torch.tensor([prompt])
    return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0)


@pytest.fixture(params=ALL_ARCHITECTURES)
def any_model(request):
    return tiny_model(request.param)


@pytest.fixture(params=MOE_ARCHITECTURES)
def moe_model(request):
    return tiny_model(request.param)


def random_eagle_head(target, draft_vocab: int = 64, seed: int = 0):
    """A random EAGLE head for `target` over `draft_vocab` random target tokens, made decisive (a
    wide output layer) so its trees are not near-uniform."""
    from moe_spec.drafters.eagle_head import EagleHead, config_for_target

    torch.manual_seed(seed)
    d2t = torch.randperm(target.vocab_size)[:draft_vocab]
    head = EagleHead(config_for_target(target, draft_vocab_size=draft_vocab), d2t)
    with torch.no_grad():
        head.lm_head.weight.normal_(0.0, 0.5)
    return head.eval()


@pytest.fixture(scope="module")
def qwen():
    """A tiny Qwen3-MoE target and a random EAGLE head for it."""
    from moe_spec.target import TargetModel

    target = TargetModel(tiny_model("qwen3_moe"))
    return target, random_eagle_head(target)
