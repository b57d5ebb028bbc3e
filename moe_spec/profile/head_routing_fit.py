"""Fitting a `HeadRoutingPredictor` to recorded routing, and scoring predicted expert sets.

    predictor = fit_head_routing(fit_nodes, embedding, table, HeadRoutingFit())
    scores = score_sets(predictor.predict_sets(...), held_out_nodes)

Scores are per MoE layer, against the routing the verify pass recorded:
- a node's recall: the share of its K actual experts among its K predicted ones (with K of each,
  its precision is the same number); over drafted nodes (roots are priced by the table in either
  predictor);
- a tree's union recall / precision: the share of the experts its nodes actually activated that
  the union of their predicted sets covers, and the share of that predicted union actually
  activated (what the cost model prices: the union is what the pass loads); over trees, root
  included.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.nn import functional as F

from moe_spec.profile.expert_table import TokenExpertTable
from moe_spec.profile.head_routing import HeadRoutingPredictor, NodeRouting

_LOG_FLOOR = 1e-6


@dataclass(frozen=True)
class HeadRoutingFit:
    """How the predictor is fitted (full-batch Adam on the softmax top-K loss, seeded)."""

    context_rank: int = 64  # R_h: the projection of rms(h)
    token_rank: int = 32  # R: the projection of the token embedding
    steps: int = 80
    learning_rate: float = 3e-2
    l2: float = 1e-4  # on every weight but the bias and the table scale
    blend_table: bool = True  # learn s_l (else s = 0: the table prices roots only)
    seed: int = 0

    def __post_init__(self):
        if self.context_rank < 1 or self.token_rank < 1:
            raise ValueError(f"context_rank and token_rank must be >= 1, got {self.context_rank}, {self.token_rank}")
        if self.steps < 1 or not self.learning_rate > 0 or self.l2 < 0:
            raise ValueError(f"steps must be >= 1, learning_rate > 0 and l2 >= 0, got {self}")


def fit_head_routing(nodes: NodeRouting, embedding: torch.Tensor, table: TokenExpertTable,
                     settings: HeadRoutingFit = HeadRoutingFit()) -> HeadRoutingPredictor:
    """The predictor fitted to `nodes`' drafted nodes (roots are left to the table).

    embedding: [V, D] the target's token embedding; table: the token table the predictor blends
    (the one the profile keeps, fitted on the same prompts' decoded text)."""
    drafted = nodes.where(nodes.depths > 0)
    if len(drafted) == 0:
        raise ValueError("no drafted nodes to fit the head routing predictor on")
    num_layers, _, top_k = drafted.experts.shape
    num_experts = table.num_experts
    generator = torch.Generator().manual_seed(settings.seed)
    hidden, vocab = drafted.features.shape[1], embedding.shape[0]
    h = F.rms_norm(drafted.features.float(), (hidden,))  # [N, D]
    emb = F.rms_norm(embedding.detach().float().cpu(), (embedding.shape[1],))  # [V, D]
    log_table = table.predict_tokens(drafted.tokens).clamp(min=_LOG_FLOOR).log()  # [L, N, E]
    target = torch.zeros(num_layers, len(drafted), num_experts).scatter_(2, drafted.experts, 1.0 / top_k)  # [L, N, E]

    def init(*shape):
        return (torch.randn(*shape, generator=generator) * 0.05).requires_grad_(True)

    projection, token_projection = init(hidden, settings.context_rank), init(emb.shape[1], settings.token_rank)
    weight = torch.zeros(settings.context_rank + settings.token_rank, num_layers * num_experts, requires_grad=True)
    bias = torch.zeros(num_layers * num_experts, requires_grad=True)
    scale = torch.zeros(num_layers, requires_grad=settings.blend_table)
    trained = [projection, token_projection, weight, bias] + ([scale] if settings.blend_table else [])
    optimizer = torch.optim.Adam(trained, lr=settings.learning_rate)
    token_emb = emb[drafted.tokens]  # [N, D]
    with torch.enable_grad():
        for _ in range(settings.steps):
            optimizer.zero_grad()
            z = torch.cat([h @ projection, token_emb @ token_projection], dim=1)  # [N, R_h + R]
            logits = torch.addmm(bias, z, weight).view(len(drafted), num_layers, num_experts).transpose(0, 1)
            logits = logits + scale.clamp(min=0)[:, None, None] * log_table
            loss = -(target * torch.log_softmax(logits, dim=-1)).sum(-1).mean()
            penalty = sum(w.pow(2).sum() for w in (projection, token_projection, weight))
            (loss + settings.l2 * penalty).backward()
            optimizer.step()
    with torch.no_grad():
        rank = settings.context_rank
        return HeadRoutingPredictor(projection, weight[:rank], emb @ token_projection, weight[rank:], bias,
                                    scale.clamp(min=0), num_experts, top_k)


@dataclass(frozen=True)
class SetScores:
    """Per MoE layer ([L] each), against held-out routing; see the module docstring."""

    node_recall: tuple[float, ...]
    node_precision: tuple[float, ...]
    union_recall: tuple[float, ...]
    union_precision: tuple[float, ...]
    nodes: int  # drafted nodes scored
    trees: int

    @property
    def union_f1(self) -> float:
        """Mean over layers of the harmonic mean of union recall and precision: how well the predicted
        union matches the union the pass loads (the profile keeps the predictor scoring higher)."""
        r, p = np.array(self.union_recall), np.array(self.union_precision)
        return float(np.mean(2 * r * p / np.maximum(r + p, 1e-12)))

    def to_dict(self) -> dict:
        return {**{k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()},
                "union_f1": self.union_f1}


def score_sets(predicted: torch.Tensor, nodes: NodeRouting, num_experts: int) -> SetScores:
    """predicted: [L, N, K'] long predicted experts of `nodes` (K' = K for top-K sets)."""
    num_layers, n, _ = nodes.experts.shape
    if predicted.shape[:2] != (num_layers, n):
        raise ValueError(f"predicted sets {tuple(predicted.shape)} do not match {num_layers} layers x {n} nodes")
    pred = torch.zeros(num_layers, n, num_experts, dtype=torch.bool).scatter_(2, predicted, True)  # [L, N, E]
    actual = torch.zeros_like(pred).scatter_(2, nodes.experts, True)
    both = (pred & actual).sum(-1).double()  # [L, N]
    drafted = nodes.depths > 0
    node_recall = (both / actual.sum(-1))[:, drafted].mean(1)
    node_precision = (both / pred.sum(-1))[:, drafted].mean(1)
    trees = torch.unique_consecutive(nodes.tree, return_counts=True)[1].tolist()
    union_recall, union_precision = [], []
    for p, a in zip(pred.split(trees, dim=1), actual.split(trees, dim=1)):
        p_union, a_union = p.any(1), a.any(1)  # [L, E]
        hit = (p_union & a_union).sum(-1).double()
        union_recall.append(hit / a_union.sum(-1))
        union_precision.append(hit / p_union.sum(-1))
    return SetScores(tuple(node_recall.tolist()), tuple(node_precision.tolist()),
                     tuple(torch.stack(union_recall).mean(0).tolist()), tuple(torch.stack(union_precision).mean(0).tolist()),
                     int(drafted.sum()), len(trees))
