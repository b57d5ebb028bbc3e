"""HeadRunner (the drafter's inference forward) computes what EagleHead.forward (the training model)
computes, tree masks included, for one row and for rows of different lengths in one batch, for
every variant of the EAGLE-3 head that published heads use."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from moe_spec.core.target import TargetModel
from moe_spec.drafters.eagle_config import config_for_target
from moe_spec.drafters.eagle_head import EagleHead, additive_mask
from moe_spec.drafters.head_runner import HeadRunner
from moe_spec.testing.tiny_models import tiny_model

torch.set_num_threads(1)
CLOSED = torch.finfo(torch.float32).min
# the head variants of published checkpoints, on one tiny target (hidden 32, 4 heads)
VARIANTS = {
    "plain": {},
    "two layers, gqa": dict(num_layers=2, kv_heads=2),
    "qk norm, three layers": dict(qk_norm=True, num_layers=3),
    "norm before residual, fc norm": dict(norm_before_residual=True, fc_norm=True),
    "norm before fc, norm output": dict(norm_before_fc=True, norm_output=True, num_layers=2),
    "logits without the final norm (specforge norm_output false)": dict(logits_norm=False),
    "own embedding, biases": dict(with_embedding=True, attention_bias=True),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request):
    """A tiny Qwen3-MoE target and a random head of one variant (norm weights randomised too)."""
    target = TargetModel(tiny_model("qwen3_moe"))
    options = dict(VARIANTS[request.param])
    with_embedding, kv, bias = options.pop("with_embedding", False), options.pop("kv_heads", 0), options.pop("attention_bias", False)
    config = config_for_target(target, draft_vocab_size=48, **options)
    layer = {**config.layer, "num_key_value_heads": kv or config.layer["num_attention_heads"], "attention_bias": bias}
    torch.manual_seed(3)
    head = EagleHead(config.with_changes(layer=layer), torch.randperm(target.vocab_size)[:48], with_embedding=with_embedding)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.3)
    return target, head.eval()


# m = 3 tree rows at one position: row 0 sees itself, rows 1-2 see row 0 and themselves
TREE = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)


def _head_forward(head, embed, g: torch.Tensor, ids: torch.Tensor, n: int) -> torch.Tensor:
    """[n + m, D] h of EagleHead.forward over n causal pairs, then the m tree rows of TREE at position n."""
    m = TREE.shape[0]
    visible = torch.cat([torch.cat([torch.tril(torch.ones(n, n, dtype=torch.bool)), torch.zeros(n, m, dtype=torch.bool)], 1),
                         torch.cat([torch.ones(m, n, dtype=torch.bool), TREE], 1)])
    positions = torch.cat([torch.arange(n), torch.full((m,), n)])
    with torch.no_grad():
        return head(g[None], embed(ids)[None], additive_mask(visible[None], torch.float32), positions[None],
                    DynamicCache())[0]


def _inputs(target, head, n: int, seed: int):
    torch.manual_seed(seed)
    m = TREE.shape[0]
    return torch.randn(n + m, head.config.hidden_size), torch.randint(0, target.vocab_size, (n + m,))


def test_runner_matches_the_head_forward(variant):
    target, head = variant
    embed = head.embedding(target.model.get_input_embeddings())
    n, m = 7, TREE.shape[0]
    g, ids = _inputs(target, head, n, seed=5)
    expected = _head_forward(head, embed, g, ids, n)
    runner = HeadRunner(head, target.model.get_input_embeddings())
    with torch.inference_mode():
        runner.refresh()
        last = runner.extend([g[:n]], [ids[:n]])  # [1, D]
        tree_mask = torch.cat([runner.prefix_mask([n])[:, None].expand(1, m, n),
                               torch.zeros(m, m).masked_fill_(~TREE, CLOSED)[None]], dim=2)  # [1, m, n + m]
        rows = runner.draft(g[None, n:], ids[None, n:], [n], tree_mask)  # [1, m, D]
    assert torch.allclose(last[0], expected[n - 1], atol=1e-5)
    assert torch.allclose(rows[0], expected[n:], atol=1e-5)
    with torch.no_grad():
        assert torch.allclose(runner.logits(rows[0]), head.logits(expected[n:]), atol=1e-4)
    assert runner.lengths == [n] and runner.rows_extended == n and runner.rows_drafted == m


@pytest.mark.parametrize("first, lengths", [(first, lengths) for first in ("extend", "write")
                                            for lengths in ([7, 3, 10], [6, 6])] + [("write", [2, 5])])
def test_each_row_of_a_batch_matches_its_own_head_forward(variant, lengths, first):
    """Row b's pairs sit at its own columns, the tree rows of all rows at shared columns past the
    longest prefix: per-row masks keep the gap hidden and the padding unread (rows of one length
    take the unmasked path). The prefix goes in by two uneven appends, so rows start the second one
    at different columns: `extend` then `extend`, or `write` (a prompt's pairs: keys and values
    only, none at all for a row of two, which `extend` refuses) then `extend`."""
    target, head = variant
    embed = head.embedding(target.model.get_input_embeddings())
    m = TREE.shape[0]
    inputs = [_inputs(target, head, n, seed=6 + b) for b, n in enumerate(lengths)]
    expected = [_head_forward(head, embed, g, ids, n) for (g, ids), n in zip(inputs, lengths)]
    runner = HeadRunner(head, target.model.get_input_embeddings(), batch=len(lengths))
    with torch.inference_mode():
        runner.refresh()
        getattr(runner, first)([g[: n - 2] for (g, _), n in zip(inputs, lengths)], [ids[: n - 2] for (_, ids), n in zip(inputs, lengths)])
        assert runner.lengths == [n - 2 for n in lengths]
        last = runner.extend([g[n - 2: n] for (g, _), n in zip(inputs, lengths)],
                             [ids[n - 2: n] for (_, ids), n in zip(inputs, lengths)])  # [B, D]
        assert runner.lengths == lengths
        tree = torch.zeros(m, m).masked_fill_(~TREE, CLOSED)
        tree_mask = torch.cat([runner.prefix_mask(lengths)[:, None].expand(-1, m, -1),
                               tree.expand(len(lengths), m, m)], dim=2)  # [B, m, max(lengths) + m]
        rows = runner.draft(torch.stack([g[n:] for (g, _), n in zip(inputs, lengths)]),
                            torch.stack([ids[n:] for (_, ids), n in zip(inputs, lengths)]), lengths, tree_mask)  # [B, m, D]
    for b, n in enumerate(lengths):
        assert torch.allclose(last[b], expected[b][n - 1], atol=1e-5), f"row {b}"
        assert torch.allclose(rows[b], expected[b][n:], atol=1e-5), f"row {b}"
    assert runner.rows_drafted == len(lengths) * m and runner.rows_extended == sum(lengths)


def test_extend_refuses_a_row_without_pairs(qwen):
    target, head = qwen
    runner = HeadRunner(head, target.model.get_input_embeddings(), batch=2)
    g, ids = _inputs(target, head, 3, seed=1)
    with torch.inference_mode(), pytest.raises(ValueError, match="counts \\[3, 0\\]"):
        runner.refresh()
        runner.extend([g[:3], g[:0]], [ids[:3], ids[:0]])

