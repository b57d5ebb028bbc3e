"""Batched speculative decoding: each row decodes exactly as it would alone."""

import pytest
import torch

from moe_spec import LookupDrafter, SpecDecoder
from moe_spec.testing.tiny_models import tiny_model

from moe_spec.testing.helpers import ALL_ARCHITECTURES, PLAIN_PROMPT, REPETITIVE_PROMPT, hf_greedy

ROWS = [REPETITIVE_PROMPT, PLAIN_PROMPT[:4], REPETITIVE_PROMPT[5:] + PLAIN_PROMPT, [7, 7, 7]]


def left_padded(rows, pad=0):
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def new_tokens_of(result, ids, row, pad):
    tokens = result.sequences[row, ids.shape[1]:].tolist()
    return tokens


@pytest.mark.parametrize("arch", ALL_ARCHITECTURES)
def test_each_row_equals_that_row_decoded_alone(arch):
    model = tiny_model(arch)
    ids, mask = left_padded(ROWS)
    result = SpecDecoder(model, drafter=LookupDrafter()).generate(ids, attention_mask=mask, max_new_tokens=16)
    assert result.sequences.shape[0] == len(ROWS)
    assert torch.equal(result.sequences[:, : ids.shape[1]], ids), "inputs come back as given"
    for row, prompt in enumerate(ROWS):
        alone = hf_greedy(model, prompt, 16)[0, len(prompt):].tolist()
        mine = result.sequences[row, ids.shape[1]:].tolist()[: len(alone)]
        assert mine == alone, f"{arch} row {row}"
    assert result.stats.mean_accept_len > 1.0
    assert max(step.rows for step in result.stats.steps) == len(ROWS)


@pytest.mark.parametrize("arch", ALL_ARCHITECTURES)
def test_rows_stay_exact_through_stale_columns_and_repacks(arch):
    """A row that accepts long paths beside rows that accept one token leaves them stale tree columns
    every step (`batch_layout.tail_layout`) until the cache is repacked; both layouts decode exactly."""
    model = tiny_model(arch)
    rows = [REPETITIVE_PROMPT * 2, PLAIN_PROMPT[:4], [7, 3, 11, 5]]
    ids, mask = left_padded(rows)
    # every row runs its 48 tokens (eos off), so the long-path row keeps leaving stale columns until a repack
    result = SpecDecoder(model, drafter=LookupDrafter()).generate(ids, attention_mask=mask, max_new_tokens=48,
                                                                  eos_token_id=[])
    for row, prompt in enumerate(rows):
        alone = hf_greedy(model, prompt, 48)[0, len(prompt):].tolist()
        assert result.sequences[row, ids.shape[1]:].tolist()[: len(alone)] == alone, f"{arch} row {row}"
    steps = result.stats.steps
    # the cache grows by the longest path; fewer tokens than rows times that were accepted: stale columns
    stale = [(b.cache_columns - a.cache_columns) * a.rows > a.accepted_length for a, b in zip(steps, steps[1:])
             if b.cache_columns >= a.cache_columns and a.rows == b.rows]
    assert any(stale), "stale columns were left behind"
    assert any(b.cache_columns < a.cache_columns for a, b in zip(steps, steps[1:])), "the cache was repacked"


def test_rows_that_stop_early_leave_the_batch_and_are_padded():
    model = tiny_model("qwen3_moe")
    alone = [hf_greedy(model, p, 16)[0, len(p):].tolist() for p in ROWS]
    eos = alone[1][3]  # row 1 stops at its 4th token; other rows stop wherever they produce it
    ids, mask = left_padded(ROWS)
    result = SpecDecoder(model, drafter=LookupDrafter()).generate(ids, attention_mask=mask, max_new_tokens=16,
                                                                  eos_token_id=eos)
    pad = model.generation_config.pad_token_id
    for row in range(len(ROWS)):
        expected = alone[row][: alone[row].index(eos) + 1] if eos in alone[row] else alone[row]
        got = result.sequences[row, ids.shape[1]:].tolist()
        assert got[: len(expected)] == expected
        assert all(t == pad for t in got[len(expected):])
    assert result.stats.steps[-1].rows < len(ROWS), "finished rows stopped costing compute"


def test_ar_batch_matches_too():
    model = tiny_model("gpt_oss")
    ids, mask = left_padded(ROWS)
    result = SpecDecoder(model).generate(ids, attention_mask=mask, max_new_tokens=10)
    for row, prompt in enumerate(ROWS):
        assert result.sequences[row, ids.shape[1]:].tolist() == hf_greedy(model, prompt, 10)[0, len(prompt):].tolist()


def test_a_drafter_without_spawn_is_refused_for_batches():
    class OneSequenceDrafter(LookupDrafter):
        spawn = None

    model = tiny_model("olmoe")
    ids, mask = left_padded(ROWS[:2])
    with pytest.raises(Exception, match="cannot draft for a batch"):
        SpecDecoder(model, drafter=OneSequenceDrafter()).generate(ids, attention_mask=mask, max_new_tokens=4)


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_padding_slots_copy_their_root_and_load_no_extra_experts(arch):
    from moe_spec.core.batch_layout import prefill_inputs, step_inputs
    from moe_spec.core.target import TargetModel
    from moe_spec.core.tree import DraftTree

    target = TargetModel(tiny_model(arch))
    prompts = [torch.tensor(REPETITIVE_PROMPT), torch.tensor(PLAIN_PROMPT)]
    trees = [DraftTree.from_lists([9, 3, 4, 5, 6], [-1, 0, 0, 1, 3]), DraftTree.root_only(11)]
    cache = target.new_cache()
    ids, mask, positions, valid = prefill_inputs(prompts, pad_token=0)
    target.forward_tree(cache, ids, mask, positions)
    ids, tree_mask, positions = step_inputs(trees, valid.sum(1))
    out = target.forward_tree(cache, ids, tree_mask, positions, prefix_valid=valid)
    experts = out.routing.experts.view(out.routing.experts.shape[0], 2, 5, -1)  # [L, B, N, K]
    for slot in range(1, 5):  # row 1's padding routes exactly as its root
        assert torch.equal(experts[:, 1, slot].sort(-1).values, experts[:, 1, 0].sort(-1).values)
        assert torch.allclose(out.logits[1, slot], out.logits[1, 0], atol=1e-5)
