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
