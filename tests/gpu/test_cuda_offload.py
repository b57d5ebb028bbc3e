"""Offloaded experts on CUDA: the `host` tier (pinned host memory, non-blocking copies into device
slots) and the `disk` tier serving a model on the device decode exactly as the resident model.

Marked `gpu` (deselected by default; `pytest -m gpu tests/gpu`), skipped without CUDA unless
MOE_SPEC_REQUIRE_CUDA=1 (the prepared device check sets it), which makes a missing device a failure.
On the CPU the `host` tier is refused by name (that part runs in the normal suite).
"""

import os

import pytest
import torch

from moe_spec import SpecDecoder
from moe_spec.errors import InputError
from moe_spec.offload.offloaded_experts import OffloadConfig, offload_experts
from moe_spec.testing.helpers import PLAIN_PROMPT
from moe_spec.testing.tiny_models import tiny_model

REQUIRE_CUDA = os.environ.get("MOE_SPEC_REQUIRE_CUDA") == "1"


def test_the_host_tier_is_refused_for_a_model_on_the_cpu(tmp_path):
    with pytest.raises(InputError, match="host.*CUDA"):
        offload_experts(tiny_model("mixtral"), OffloadConfig(tmp_path, tier="host", resident=2))


@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("resident", [2, 5, 0])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() and not REQUIRE_CUDA, reason="needs a CUDA device")
def test_offloaded_decoding_on_the_device_equals_the_resident_model(tier, arch, resident, tmp_path):
    assert torch.cuda.is_available(), "MOE_SPEC_REQUIRE_CUDA=1 but torch sees no CUDA device"
    reference = tiny_model(arch).to("cuda")
    model = tiny_model(arch).to("cuda")
    offload = offload_experts(model, OffloadConfig(tmp_path / "store", tier=tier, resident=resident))
    ids = torch.tensor([PLAIN_PROMPT], device="cuda")
    try:
        got = SpecDecoder(model, offload=offload).generate(ids, max_new_tokens=16)
        want = SpecDecoder(reference).generate(ids, max_new_tokens=16)
        assert torch.equal(got.sequences, want.sequences)
        assert got.stats.misses_per_token > 0
    finally:
        offload.close()
