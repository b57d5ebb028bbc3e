"""Predicting, before verification, which experts each draft node will activate.

`TokenExpertTable` predicts from the token id alone (routing is strongly token-id driven in
early layers): p[l, n, e] = (c[v, l, e] + a * prior[l, e]) / (c[v] + a), where c counts how often
token id v was routed to expert e in layer l in decoded text, prior[l, e] is the layer's load
per token (rows sum to K) and a is a pseudo-count; unseen ids get the prior. Each node's row
sums to K. A predictor from the draft head's features (trained with the head) would implement
the same `ExpertPredictor` protocol.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from moe_spec.core.step_record import StepRecord
from moe_spec.core.tree import DraftTree
from moe_spec.profile.cost_model import expected_unique_experts
from moe_spec.profile.expert_masks import masks_of_ids


class ExpertPredictor(Protocol):
    def predict(self, tree: DraftTree) -> torch.Tensor:
        """[L, N, E] probability that node n activates expert e in MoE layer l."""


class TokenExpertTable:
    def __init__(
        self,
        token_ids: np.ndarray,  # [S] int: token ids with observations
        token_totals: np.ndarray,  # [S] int: observations of each
        token_counts: np.ndarray,  # [S, L, E] int: routings of each to each expert
        prior: np.ndarray,  # [L, E] float: expected routings per token (rows sum to K)
        vocab_size: int,
        top_k: int,
        pseudo_count: float = 1.0,
    ):
        self.token_ids = np.asarray(token_ids, dtype=np.int64)
        self.token_totals = np.asarray(token_totals, dtype=np.int64)
        self.token_counts = np.asarray(token_counts)
        self.prior = np.asarray(prior, dtype=np.float64)
        self.vocab_size, self.top_k, self.pseudo_count = int(vocab_size), int(top_k), float(pseudo_count)
        num_layers, num_experts = self.prior.shape
        if self.token_counts.shape != (len(self.token_ids), num_layers, num_experts):
            raise ValueError(f"token_counts {self.token_counts.shape} != [{len(self.token_ids)}, {num_layers}, {num_experts}]")
        # [V, L, E] float32 lookup, built once: unseen ids hold the prior
        table = np.broadcast_to(self.prior, (self.vocab_size, num_layers, num_experts)).astype(np.float32)
        seen = (self.token_counts + self.pseudo_count * self.prior) / (self.token_totals[:, None, None] + self.pseudo_count)
        table[self.token_ids] = seen
        self._table = torch.from_numpy(table)
        # [V, L, E] 0/1: each token id's K most likely experts per layer, built once (pricing reads it every step)
        top = self._table.topk(self.top_k, dim=-1).indices
        self._onehot = torch.zeros_like(self._table).scatter_(2, top, 1.0)
        # [V, L*K] the same sets as flat (layer * E + expert) ids, ascending
        self._flat_ids = (top.sort(dim=-1).values + torch.arange(num_layers)[:, None] * num_experts).flatten(1).numpy()

    @staticmethod
    def from_counts(
        token_totals: np.ndarray,  # [V] int: routings seen of each token id
        token_counts: np.ndarray,  # [V, L, E] int: how often token id v was routed to expert e in layer l
        load: np.ndarray,  # [L, E] int: tokens routed to each expert
        top_k: int,
        pseudo_count: float = 1.0,
    ) -> "TokenExpertTable":
        """The table of routing counts over a vocabulary (`moe_spec.measure.routing_stats.RoutingStats`)."""
        token_totals = np.asarray(token_totals)
        seen = np.nonzero(token_totals)[0]
        prior = np.asarray(load) / max(int(token_totals.sum()), 1)  # [L, E], rows sum to K
        counts = np.minimum(np.asarray(token_counts)[seen], np.iinfo(np.uint16).max).astype(np.uint16)
        return TokenExpertTable(seen, token_totals[seen], counts, prior, len(token_totals), top_k, pseudo_count)

    @property
    def num_layers(self) -> int:
        return self.prior.shape[0]

    @property
    def num_experts(self) -> int:
        return self.prior.shape[1]

    def predict_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: [N] long -> [L, N, E] float32 probabilities."""
        return self._table[tokens.cpu().long()].permute(1, 0, 2).contiguous()

    def predict(self, tree: DraftTree) -> torch.Tensor:
        """[L, N, E] probability that node n activates expert e in layer l."""
        return self.predict_tokens(tree.tokens)

    def predict_onehot(self, tree: DraftTree) -> torch.Tensor:
        """[L, N, E] 0/1: each node's K most likely experts per layer (a sharper input for pricing
        than `predict`, whose small probabilities add up over many nodes)."""
        return self.predict_onehot_tokens(tree.tokens)

    @property
    def onehot_by_token(self) -> np.ndarray:
        """[V, L, E] float32 0/1: each token id's K most likely experts per layer (a view)."""
        return self._onehot.numpy()

    @property
    def flat_ids_by_token(self) -> np.ndarray:
        """[V, L*K] int64: each token id's K most likely experts per layer, as flat (layer * E +
        expert) ids (the sets `onehot_by_token` marks; a view)."""
        return self._flat_ids

    def flat_id_mask(self, token: int) -> int:
        """A token id's row of `flat_ids_by_token` as a bit mask (bit x set: flat id x): what a
        controller pricing 0/1 sets in plain Python reads for every row's root, every step. Every
        id's mask is built on the first call (a few ms, once)."""
        masks = self.__dict__.get("_flat_id_masks")
        if masks is None:
            masks = masks_of_ids(self._flat_ids, self.num_layers * self.num_experts)
            self.__dict__["_flat_id_masks"] = masks
        if not 0 <= token < self.vocab_size:
            raise ValueError(f"token must be an id in 0..{self.vocab_size - 1}, got {token}")
        return masks[token]

    def predict_onehot_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: [N] long -> [L, N, E] 0/1, as `predict_onehot`."""
        return self._onehot[tokens.cpu().long()].permute(1, 0, 2).contiguous()

    def predict_sets(self, tokens: torch.Tensor) -> torch.Tensor:
        """[L, N, K] long: each node's K most likely experts per layer."""
        return self.predict_tokens(tokens).topk(self.top_k, dim=-1).indices

    def arrays(self) -> dict[str, np.ndarray]:
        """What the profile's sidecar stores (exact counts: the table is rebuilt from them)."""
        return {
            "predictor_token_ids": self.token_ids.astype(np.int32),
            "predictor_token_totals": self.token_totals.astype(np.int32),
            "predictor_token_counts": self.token_counts.astype(np.uint16),
            "predictor_prior": self.prior.astype(np.float64),
        }

    @staticmethod
    def from_arrays(arrays, vocab_size: int, top_k: int, pseudo_count: float) -> "TokenExpertTable":
        return TokenExpertTable(
            arrays["predictor_token_ids"], arrays["predictor_token_totals"], arrays["predictor_token_counts"],
            arrays["predictor_prior"], vocab_size, top_k, pseudo_count,
        )


@dataclass(frozen=True)
class PredictorReport:
    """Against the routing recorded on held-out trees (drafted nodes, root included)."""

    node_recall: tuple[float, ...]  # [L] share of a node's actual K experts in its predicted top-K
    node_recall_seen: float  # mean over layers, nodes whose token id the table had seen
    node_recall_unseen: float
    union_recall: tuple[float, ...]  # [L] share of the tree's actual experts in the predicted union
    union_precision: tuple[float, ...]  # [L] share of the predicted union actually activated
    unique_relative_error: tuple[float, ...]  # [L] mean |expected U - actual U| / actual U, from `predict`
    unique_relative_error_topk: tuple[float, ...]  # [L] same, U of the union of predicted top-K sets
    chance_recall: float  # K / E
    nodes: int
    trees: int

    def to_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}


def evaluate_predictor(table: TokenExpertTable, steps: Sequence[StepRecord]) -> PredictorReport:
    """Recall and precision of the table's predictions against routing recorded on `steps`' verified
    trees (one-row records, `StepRecord.row`).

    With K predicted experts per node and K actual ones, a node's precision equals its recall.
    """
    num_layers, num_experts, top_k = table.num_layers, table.num_experts, table.top_k
    seen_ids = set(table.token_ids.tolist())
    hits = np.zeros(num_layers)
    hits_seen = hits_unseen = 0.0
    nodes = nodes_seen = nodes_unseen = 0
    union_recall, union_precision, unique_error, unique_error_topk = [], [], [], []
    for step in steps:
        tokens = step.tree().tokens
        predicted = table.predict_sets(tokens)  # [L, N, K]
        actual = step.experts()  # [L, N, K]
        pred_onehot = torch.zeros(num_layers, len(tokens), num_experts, dtype=torch.bool).scatter_(2, predicted, True)
        act_onehot = torch.zeros_like(pred_onehot).scatter_(2, actual, True)
        overlap = (pred_onehot & act_onehot).sum(-1).double() / top_k  # [L, N]
        hits += overlap.sum(1).numpy()
        is_seen = torch.tensor([t in seen_ids for t in tokens.tolist()])
        hits_seen += float(overlap[:, is_seen].mean(0).sum())
        hits_unseen += float(overlap[:, ~is_seen].mean(0).sum())
        nodes += len(tokens)
        nodes_seen += int(is_seen.sum())
        nodes_unseen += int((~is_seen).sum())
        pred_union, act_union = pred_onehot.any(1), act_onehot.any(1)  # [L, E]
        both = (pred_union & act_union).sum(-1).double()
        union_recall.append((both / act_union.sum(-1)).numpy())
        union_precision.append((both / pred_union.sum(-1)).numpy())
        expected = expected_unique_experts(table.predict_tokens(tokens))  # [L]
        actual_unique = act_union.sum(-1).double()
        unique_error.append(((expected - actual_unique).abs() / actual_unique).numpy())
        topk_unique = pred_union.sum(-1).double()
        unique_error_topk.append(((topk_unique - actual_unique).abs() / actual_unique).numpy())
    nan = float("nan")
    return PredictorReport(
        node_recall=tuple((hits / max(nodes, 1)).tolist()),
        node_recall_seen=hits_seen / nodes_seen if nodes_seen else nan,
        node_recall_unseen=hits_unseen / nodes_unseen if nodes_unseen else nan,
        union_recall=tuple(np.mean(union_recall, axis=0).tolist()) if steps else (),
        union_precision=tuple(np.mean(union_precision, axis=0).tolist()) if steps else (),
        unique_relative_error=tuple(np.mean(unique_error, axis=0).tolist()) if steps else (),
        unique_relative_error_topk=tuple(np.mean(unique_error_topk, axis=0).tolist()) if steps else (),
        chance_recall=top_k / num_experts,
        nodes=nodes,
        trees=len(steps),
    )
