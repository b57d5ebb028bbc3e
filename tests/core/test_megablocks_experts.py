"""The megablocks experts implementation: a clear error where megablocks is missing, and its
forward (around a reference grouped GEMM) equal to transformers' own grouped_mm."""

import importlib.util

import pytest
import torch

from moe_spec.errors import InputError
from moe_spec.core import megablocks_experts
from moe_spec.testing.tiny_models import tiny_model

HAVE_MEGABLOCKS = importlib.util.find_spec("megablocks") is not None


def loop_gmm(a: torch.Tensor, b: torch.Tensor, batch_sizes: torch.Tensor, trans_b: bool = False) -> torch.Tensor:
    """grouped_gemm's contract, one matmul per expert: a [S, in], b [E, out, in] (trans_b) or [E, in, out]."""
    assert batch_sizes.device.type == "cpu" and batch_sizes.dtype == torch.int64
    outs, start = [], 0
    for expert, rows in enumerate(batch_sizes.tolist()):
        weight = b[expert].t() if trans_b else b[expert]
        outs.append(a[start: start + rows] @ weight)
        start += rows
    return torch.cat(outs)


@pytest.fixture
def reference_name():
    """Registers the forward around `loop_gmm` under a test-only name, removed afterwards."""
    from transformers.integrations.moe import ExpertsInterface

    name = "megablocks-loop-test"
    megablocks_experts.register(loop_gmm, name)
    yield name
    ExpertsInterface._global_mapping.pop(name, None)


@pytest.mark.skipif(HAVE_MEGABLOCKS, reason="megablocks is installed here")
def test_asking_for_megablocks_without_it_is_a_clear_input_error():
    from moe_spec.loading import load_target

    with pytest.raises(InputError, match=r"'megablocks' needs the megablocks package.*moe_spec\[gpu\]"):
        load_target(None, experts_implementation="megablocks")


@pytest.mark.skipif(HAVE_MEGABLOCKS, reason="megablocks is installed here")
def test_the_cli_reports_a_missing_megablocks_and_exits_2(capsys):
    from moe_spec.cli.main import main

    code = main(["generate", "--prompt-ids", "5 6 7", "--max-new-tokens", "2", "--experts-implementation", "megablocks"])
    assert code == 2
    assert "needs the megablocks package" in capsys.readouterr().err


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_the_grouped_gemm_forward_equals_transformers_grouped_mm(arch, reference_name):
    """gpt_oss: transposed weights, biases and its own gate; the others: [E, out, in] weights."""
    model = tiny_model(arch)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    with torch.no_grad():
        model.set_experts_implementation("grouped_mm")
        expected = model(ids).logits
        model.set_experts_implementation(reference_name)
        got = model(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
