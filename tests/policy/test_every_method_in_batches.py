"""Every registry method is lossless in a batch: B = 4, ragged left-padded prompts, one row that
finishes early (EOS) and leaves the batch, every row equal to transformers' greedy of it alone, and
drafts verified and accepted (so the comparison is not plain decoding against itself)."""

import pytest
import torch

from moe_spec.core.inputs import left_pad
from moe_spec import LookupDrafter, SpecDecoder
from moe_spec.core.stats import GenerationStats
from moe_spec.core.target import TargetModel
from moe_spec.measure.latency import TimingConfig
from moe_spec.measure.profiler import ProfileSettings, build_profile
from moe_spec.policy.registry import AR, build_controller, runnable_names
from moe_spec.testing.helpers import PLAIN_PROMPT, REPETITIVE_PROMPT, assert_speculated, hf_greedy
from moe_spec.testing.tiny_models import tiny_model

ROWS = [REPETITIVE_PROMPT, PLAIN_PROMPT[:4], REPETITIVE_PROMPT[5:] + PLAIN_PROMPT, [7, 7, 7]]
NEW_TOKENS = 16
QUICK = ProfileSettings(
    max_new_tokens=16, prefix_len=16, grid_tokens=(1, 4, 16), grid_experts=(2, 4, 8), natural_trees=6,
    curve_sizes=(1, 2, 4, 8), batch_sizes=(2, 4), timing=TimingConfig(repeats=2, warmup=1, evict_mb=0),
)


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def profiled(request):
    model = tiny_model(request.param)
    target = TargetModel(model)
    prompts = [torch.tensor(p) for p in (*ROWS, [30, 31, 32, 33] * 4)]
    return model, target, build_profile(target, LookupDrafter(), prompts, QUICK)


@pytest.mark.parametrize("method", runnable_names())
def test_every_method_decodes_a_ragged_batch_with_a_finished_row_as_each_row_alone(profiled, method):
    model, target, profile = profiled
    alone = [hf_greedy(model, p, NEW_TOKENS)[0, len(p):].tolist() for p in ROWS]
    eos = alone[1][3]  # row 1 stops at its 4th token; other rows stop wherever they produce it
    ids, mask = left_pad([torch.tensor([r]) for r in ROWS], pad=0)  # [B, width] each
    width = ids.shape[1]
    controller = build_controller(method, lambda: profile)
    drafter = None if method == AR else LookupDrafter()
    result = SpecDecoder(target, drafter=drafter, controller=controller).generate(
        ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, eos_token_id=eos)
    pad = model.generation_config.pad_token_id
    for row in range(len(ROWS)):
        expected = alone[row][: alone[row].index(eos) + 1] if eos in alone[row] else alone[row]
        got = result.sequences[row, width:].tolist()
        assert got[: len(expected)] == expected, f"{method} row {row}"
        assert all(t == pad for t in got[len(expected):]), f"{method} row {row} is padded after it finished"
    assert result.stats.steps[-1].rows < len(ROWS), "the finished row left the batch"
    if method != AR:
        assert_speculated(GenerationStats(steps=result.stats.steps))


def test_a_decoder_that_never_drafts_passes_identity_but_fails_the_speculation_check(profiled):
    """The deliberately broken variant: plain decoding is token-identical to greedy, so identity alone
    cannot tell it from speculation; `assert_speculated` can."""
    model, target, profile = profiled
    result = SpecDecoder(target, drafter=None).generate(torch.tensor([REPETITIVE_PROMPT]), max_new_tokens=NEW_TOKENS)
    assert torch.equal(result.sequences, hf_greedy(model, REPETITIVE_PROMPT, NEW_TOKENS))
    with pytest.raises(AssertionError, match="no drafted node was verified"):
        assert_speculated(result.stats)
