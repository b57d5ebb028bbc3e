import os

import pytest
import torch

from moe_spec.core.target import TargetModel
from moe_spec.testing.helpers import ALL_ARCHITECTURES, random_eagle_head
from moe_spec.testing.tiny_models import MOE_ARCHITECTURES, tiny_model


def pytest_configure(config):
    # one thread by default: the tests time nothing, and two workers on two cores stay independent
    torch.set_num_threads(int(os.environ.get("MOE_SPEC_TEST_THREADS", "1")))
    # profiles the commands cache go to a folder of this run, never the user's ~/.cache (subprocesses inherit it)
    if "MOE_SPEC_CACHE" not in os.environ:
        import tempfile

        os.environ["MOE_SPEC_CACHE"] = tempfile.mkdtemp(prefix="moe_spec_test_cache_")


@pytest.fixture(params=ALL_ARCHITECTURES)
def any_model(request):
    return tiny_model(request.param)


@pytest.fixture(params=MOE_ARCHITECTURES)
def moe_model(request):
    return tiny_model(request.param)


@pytest.fixture(scope="module")
def qwen():
    """A tiny Qwen3-MoE target and a random EAGLE head for it."""
    target = TargetModel(tiny_model("qwen3_moe"))
    return target, random_eagle_head(target)
