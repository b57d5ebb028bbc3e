"""Golden outputs of the reference implementation: speculators 0.9.0's own `Eagle3DraftModel`, run once by
`scripts/make_eagle3_golden.py` (in a venv of its own) on random heads it saved itself. Each fixture holds
the head folder as speculators wrote it, the inputs and its logits of a first pass and of a second
training-time-test step; `meta.json` says how each was fed. moe_spec must load those folders as they
are and compute the same logits: through `EagleHead.forward`, through its training unroll, and through
the drafter's runner."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import DynamicCache

from moe_spec.drafters.eagle_head import EagleHead, additive_mask
from moe_spec.drafters.head_layouts import LAYOUTS, save_head
from moe_spec.drafters.head_runner import HeadRunner

GOLDEN = Path(__file__).parents[1] / "fixtures" / "eagle3_golden"
VARIANTS = sorted(p.name for p in GOLDEN.iterdir() if p.is_dir())
TOL = dict(atol=2e-5, rtol=1e-4)


@pytest.fixture(params=VARIANTS)
def golden(request):
    folder = GOLDEN / request.param
    return EagleHead.from_pretrained(folder / "head"), load_file(folder / "io.safetensors"), json.loads(
        (folder / "meta.json").read_text())


def _features(head: EagleHead, io: dict) -> torch.Tensor:
    """[1, T, 3 Ht] concatenated aux states -> [1, T, S, Ht]."""
    return io["hidden_states"].view(1, io["hidden_states"].shape[1], head.config.num_feature_layers, -1)


def test_the_fixtures_cover_the_variants_published_heads_use():
    flags = {v: json.loads((GOLDEN / v / "meta.json").read_text())["config_flags"] for v in VARIANTS}
    assert any(f["norm_before_residual"] for f in flags.values())
    assert any(f["target_hidden_size"] for f in flags.values())
    assert any(f["num_hidden_layers"] > 1 for f in flags.values())
    assert any(f["fc_norm"] and f["norm_output"] for f in flags.values())
    assert any(f["num_key_value_heads"] < f["num_attention_heads"] for f in flags.values())


def test_first_pass_and_second_step_logits_equal_the_reference(golden):
    head, io, meta = golden
    t = io["input_ids"].shape[1]
    assert meta["versions"]["speculators"] == "0.9.0" and head.layout == "speculators"
    cache = DynamicCache()
    causal = torch.tril(torch.ones(t, t, dtype=torch.bool))
    with torch.no_grad():
        out = head(head.fuse(_features(head, io)), head.embed_tokens(io["input_ids"]),
                   additive_mask(causal[None], torch.float32), io["position_ids"], cache)
        torch.testing.assert_close(head.logits(out), io["logits"], **TOL)
        torch.testing.assert_close(out, io["hidden_ttt1_in"], **TOL)  # what deeper drafts read (normed under norm_output)
        # step 2: row t sees the first pass's rows 0..t and itself, one position later
        seen = torch.cat([causal, torch.eye(t, dtype=torch.bool)], dim=1)  # [T, 2T]
        second = head(out, head.embed_tokens(io["input_ids_ttt1"]), additive_mask(seen[None], torch.float32),
                      io["position_ids_ttt1"], cache)
        torch.testing.assert_close(head.logits(second), io["logits_ttt1"], **TOL)


def test_the_training_unroll_reproduces_the_reference_steps(golden):
    """moe_spec's unroll pairs (features t, token t+1) and feeds pass k at t from pass k-1 at t-1; the
    reference aligns rows instead. Row t of its step 2 is row t+1 of pass 1 here."""
    head, io, _ = golden
    features = torch.cat([_features(head, io), torch.zeros_like(_features(head, io)[:, :1])], dim=1)  # [1, T+1, S, Ht]
    tokens = torch.cat([torch.zeros(1, 1, dtype=torch.long), io["input_ids"]], dim=1)  # x_0 (unread), x_1..x_T
    with torch.no_grad():
        first, second = head.unroll(features, head.embed_tokens(tokens), steps=2)
        torch.testing.assert_close(head.logits(first), io["logits"], **TOL)
        torch.testing.assert_close(head.logits(second[:, 1:]), io["logits_ttt1"][:, :-1], **TOL)


def test_the_drafters_runner_reproduces_the_reference(golden):
    """The runner the drafter uses: the first pass causally (`extend` returns the last row only, so one
    row at a time), then each row's second step as a one-node tree under it."""
    head, io, _ = golden
    t = io["input_ids"].shape[1]
    runner = HeadRunner(head, head.embed_tokens)
    with torch.inference_mode():
        runner.refresh()
        g = head.fuse(_features(head, io))[0]  # [T, H]
        firsts = [runner.extend([g[i:i + 1]], [io["input_ids"][0, i:i + 1]])[0] for i in range(t)]
        torch.testing.assert_close(runner.logits(torch.stack(firsts)), io["logits"][0], **TOL)
        last = t - 1  # a node under the last pair: the prefix 0..T-1, then itself at position T
        mask = torch.zeros(1, 1, t + 1)
        node = runner.draft(firsts[last][None, None], io["input_ids_ttt1"][:, last:last + 1],
                            [int(io["position_ids_ttt1"][0, last])], mask)
        torch.testing.assert_close(runner.logits(node[0]), io["logits_ttt1"][0, last:], **TOL)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_that_can_hold_a_variant_reproduces_it(golden, layout, tmp_path):
    head, io, _ = golden
    try:
        save_head(head, tmp_path, layout, dtype=torch.float32)
    except ValueError as error:  # a layout without this variant says so
        assert "save it in the speculators layout" in str(error)
        return
    again = EagleHead.from_pretrained(tmp_path)
    t = io["input_ids"].shape[1]
    mask = additive_mask(torch.tril(torch.ones(t, t, dtype=torch.bool))[None], torch.float32)
    with torch.no_grad():
        out = again(again.fuse(_features(again, io)), again.embed_tokens(io["input_ids"]), mask, io["position_ids"],
                    DynamicCache())
        torch.testing.assert_close(again.logits(out), io["logits"], **TOL)
