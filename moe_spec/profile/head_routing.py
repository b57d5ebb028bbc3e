"""Predicting each draft node's experts from what the draft head computed for it.

`TokenExpertTable` sees a node's token id only, and routing in a deep MoE layer depends on the
context as much as on the token: the table recalls most of a node's experts in the first layers
and under half in the last ones. A drafted node x under parent p was proposed from the head's
output at p, h_p [D] (`DraftTree.node_features`), which summarises the context the node is
drafted in at no extra head forward. `HeadRoutingPredictor` reads it together with the node's
token id:

    logits[l, n, :] = W_l (rms(h_n) A) + U_l t[x_n] + b_l + s_l log p_table[l, x_n, :]

one linear map per MoE layer from a rank-R_h projection of rms(h) (h scaled to unit RMS; the
projection A [D, R_h] keeps the stored weights small for a wide target), t[v] [R] (a rank-R
projection of the target's RMS-normalised token embedding of v, stored per token id so that no
target is needed to predict), and the token table's log-probabilities scaled by a learnt s_l >= 0
(the blend; s = 0 reads no table). At decode time it is three small matmuls for the tree's nodes. A node's predicted experts are its K largest logits, priced as a 0/1 set (the
form whose union is what the verify pass loads). Fitting (`fit_head_routing`) minimises the
softmax cross-entropy of each layer's logits against the node's K actual experts (1/K each: a
listwise top-K loss) with an L2 penalty, full batch, in float32 on the CPU.

The root has no computed parent output (its features are zeros): roots are priced by the table.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import numpy as np
import torch
from torch.nn import functional as F

from moe_spec.profile.expert_masks import masks_of_bits
from moe_spec.profile.expert_table import TokenExpertTable

# the sidecar names of `HeadRoutingPredictor.arrays`, with their shapes in the fingerprint's letters
ARRAY_SHAPES = {
    "head_routing_context_projection": ("D", "Rh"),  # A: rms(h) -> [R_h]
    "head_routing_context_weight": ("Rh", "L*E"),  # W: rms(h) A -> logits
    "head_routing_token_vectors": ("V", "R"),  # t: a token id's projected embedding
    "head_routing_token_weight": ("R", "L*E"),  # U: t -> logits
    "head_routing_bias": ("L*E",),  # b
    "head_routing_table_scale": ("L",),  # s: weight of the table's log-probabilities
}
_RMS_EPS = float(np.finfo(np.float32).eps)  # what F.rms_norm adds without an eps
_LOG_FLOOR = 1e-6  # the table's probabilities are floored before the log (its pseudo-count keeps them > 0)


class HeadRoutingPredictor:
    def __init__(
        self,
        context_projection: np.ndarray | torch.Tensor,  # [D, R_h]
        context_weight: np.ndarray | torch.Tensor,  # [R_h, L*E]
        token_vectors: np.ndarray | torch.Tensor,  # [V, R]
        token_weight: np.ndarray | torch.Tensor,  # [R, L*E]
        bias: np.ndarray | torch.Tensor,  # [L*E]
        table_scale: np.ndarray | torch.Tensor,  # [L], >= 0
        num_experts: int,
        top_k: int,
    ):
        as_float = lambda a: torch.as_tensor(np.asarray(a, dtype=np.float32) if isinstance(a, np.ndarray) else a,
                                             dtype=torch.float32).detach().contiguous()
        self.context_projection = as_float(context_projection)
        self.context_weight, self.token_vectors = as_float(context_weight), as_float(token_vectors)
        self.token_weight, self.bias, self.table_scale = as_float(token_weight), as_float(bias), as_float(table_scale)
        self.num_experts, self.top_k = int(num_experts), int(top_k)
        num_layers = self.table_scale.shape[0] if self.table_scale.dim() == 1 else -1
        outputs = num_layers * self.num_experts
        hidden, context_rank = self.context_projection.shape[0], self.context_projection.shape[-1]
        rank = self.token_vectors.shape[-1]
        shapes = {"context_projection": (self.context_projection.shape, (hidden, context_rank)),
                  "context_weight": (self.context_weight.shape, (context_rank, outputs)),
                  "token_vectors": (self.token_vectors.shape, (self.token_vectors.shape[0], rank)),
                  "token_weight": (self.token_weight.shape, (rank, outputs)),
                  "bias": (self.bias.shape, (outputs,)), "table_scale": (self.table_scale.shape, (num_layers,))}
        bad = [f"{name} {tuple(got)} (want {want})" for name, (got, want) in shapes.items() if tuple(got) != want]
        if num_layers < 1 or not 1 <= self.top_k <= self.num_experts or bad:
            raise ValueError(f"head routing predictor shapes disagree (layers {num_layers}, experts {self.num_experts}, "
                             f"top_k {self.top_k}): {', '.join(bad) or 'no layers or top_k out of range'}")
        if not all(bool(torch.isfinite(t).all()) for t in (self.context_projection, self.context_weight,
                                                            self.token_vectors, self.token_weight, self.bias,
                                                            self.table_scale)):
            raise ValueError("head routing predictor weights must be finite")
        if bool((self.table_scale < 0).any()):
            raise ValueError("head routing predictor table_scale must be >= 0")
        self._layer_offsets = (np.arange(num_layers, dtype=np.int64) * self.num_experts)[:, None]  # [L, 1] first flat ids

    @property
    def num_layers(self) -> int:
        return int(self.table_scale.shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self.context_projection.shape[0])

    @property
    def vocab_size(self) -> int:
        return int(self.token_vectors.shape[0])

    def logits(self, features: torch.Tensor, tokens: torch.Tensor, table: TokenExpertTable | None) -> torch.Tensor:
        """features: [N, D] parents' head outputs; tokens: [N] long -> [L, N, E] float32 logits.
        `table` is needed exactly when some table_scale is nonzero."""
        features, tokens = self._checked(features, tokens)
        h = F.rms_norm(features.cpu().float(), (self.hidden_size,)) @ self.context_projection  # [N, R_h]
        flat = torch.addmm(self._token_terms(table)[tokens], h, self.context_weight)  # [N, L*E]
        return flat.view(len(tokens), self.num_layers, self.num_experts).transpose(0, 1)  # [L, N, E]

    def _checked(self, features: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(features [N, D] float32, tokens [N] long) on the CPU, or a ValueError naming what is wrong."""
        tokens = tokens.cpu().long()
        if features.dim() != 2 or features.shape != (len(tokens), self.hidden_size):
            raise ValueError(f"features must be [{len(tokens)}, {self.hidden_size}] (the head's hidden size), "
                             f"got {tuple(features.shape)}")
        ids = tokens.tolist()  # a few dozen: Python's min and max cost less than two torch reductions
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            raise ValueError(f"tokens must be ids in 0..{self.vocab_size - 1}")
        return (features.detach() if features.requires_grad else features).cpu().float(), tokens

    def _token_terms(self, table: TokenExpertTable | None) -> torch.Tensor:
        """[V, L*E] what the logits owe to the token alone: bias + its vector's term + the blended
        table's log-probabilities, computed once per table (on the controller's critical path every
        step, the per-call matmul and table lookup cost more than the gather)."""
        blended = bool(self.table_scale.any())
        if blended and table is None:
            raise ValueError("this head routing predictor blends the token table: pass it as `table`")
        key = id(table) if blended else None
        cached = self.__dict__.get("_terms")
        if cached is not None and cached[0] == key:
            return cached[1]
        terms = torch.addmm(self.bias, self.token_vectors, self.token_weight)  # [V, L*E]
        if blended:
            vocab = torch.arange(self.vocab_size)
            log_p = table.predict_tokens(vocab).clamp(min=_LOG_FLOOR).log()  # [L, V, E]
            terms = terms + (self.table_scale[:, None, None] * log_p).transpose(0, 1).reshape(self.vocab_size, -1)
        self.__dict__["_terms"] = (key, terms)
        return terms

    def predict_sets(self, features: torch.Tensor, tokens: torch.Tensor, table: TokenExpertTable | None) -> torch.Tensor:
        """[L, N, K] long: each node's K predicted experts per layer."""
        return self.logits(features, tokens, table).topk(self.top_k, dim=-1).indices

    def predict_onehot(self, features: torch.Tensor, tokens: torch.Tensor, depths: torch.Tensor,
                       table: TokenExpertTable) -> torch.Tensor:
        """[L, N, E] 0/1 predicted experts: the K largest logits, roots (depth 0, no parent output) the
        table's top-K (the sets `predict_flat_ids` gives, marked)."""
        flat = self.predict_flat_ids(features, tokens, depths, table)  # [N, L*K]
        onehot = np.zeros((len(flat), self.num_layers * self.num_experts), dtype=np.float32)
        np.put_along_axis(onehot, flat, 1.0, axis=1)
        return torch.from_numpy(onehot.reshape(len(flat), self.num_layers, self.num_experts).transpose(1, 0, 2))  # a view

    def predict_flat_ids(self, features: torch.Tensor, tokens: torch.Tensor, depths, table: TokenExpertTable) -> np.ndarray:
        """[N, L*K] int64: each node's K predicted experts per layer (the K largest logits; roots, at
        depth 0 with no parent output, the table's top-K) as flat (layer * E + expert) ids, layer by
        layer."""
        logits = self._drafted_logits(features, tokens, table)  # [N, L, E]
        top = np.argpartition(logits, -self.top_k, axis=-1)[..., -self.top_k:]  # [N, L, K]
        flat = (top + self._layer_offsets).reshape(len(logits), -1)  # [N, L*K]
        roots = [node for node, depth in enumerate(np.asarray(depths).tolist()) if depth == 0]
        if roots:
            flat[roots] = table.flat_ids_by_token[tokens.cpu().numpy()[roots]]
        return flat

    def predict_drafted_masks(self, features: torch.Tensor, tokens: torch.Tensor, table: TokenExpertTable | None) -> list[int]:
        """Each node's predicted experts (the K largest logits per layer, as `predict_flat_ids`) as
        a bit mask over flat ids (`expert_masks`), every node read as a drafted one: a root's
        (zero features) means nothing, and its caller prices roots by the table. The K largest are
        those at or above each layer's K-th largest logit (a tie there, which float logits of a
        fitted map do not make, would mark more)."""
        logits = self._drafted_logits(features, tokens, table)  # [N, L, E]
        kth = np.partition(logits, -self.top_k, axis=-1)[..., -self.top_k, None]  # [N, L, 1]
        return masks_of_bits((logits >= kth).reshape(len(logits), -1))

    def _drafted_logits(self, features: torch.Tensor, tokens: torch.Tensor, table: TokenExpertTable | None) -> np.ndarray:
        """[N, L, E] float32 `logits` in numpy, node-major (the controller calls it every step on a
        few dozen nodes, where each torch op's dispatch costs more than its arithmetic)."""
        features, tokens = self._checked(features, tokens)
        ids = tokens.numpy()
        projection, weight, terms = self._numpy_weights(table)
        h = features.numpy()
        # rms(h) A = (h A) / rms(h): the norm applied to the [N, R_h] projection, its N scalars in
        # Python (the fewest numpy calls, each costing more than its arithmetic right after the
        # target's forward)
        squares = np.vecdot(h, h).tolist()  # [N]
        context = h @ projection  # [N, R_h]
        context *= np.array([1.0 / math.sqrt(s / self.hidden_size + _RMS_EPS) for s in squares], dtype=np.float32)[:, None]
        logits = terms[ids]  # [N, L*E], a copy
        logits += context @ weight
        return logits.reshape(len(ids), self.num_layers, self.num_experts)

    def _numpy_weights(self, table: TokenExpertTable | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(A [D, R_h], W [R_h, L*E], token terms [V, L*E]) as numpy arrays sharing the tensors' memory
        (kept while the token terms are)."""
        cached = self.__dict__.get("_numpy")  # (table, arrays): the token terms depend on the table only
        if cached is None or cached[0] is not table:
            terms = self._token_terms(table)
            cached = (table, (self.context_projection.numpy(), self.context_weight.numpy(), terms.numpy()))
            self.__dict__["_numpy"] = cached
        return cached[1]

    def arrays(self) -> dict[str, np.ndarray]:
        """What the profile's sidecar stores (`ARRAY_SHAPES`)."""
        return {
            "head_routing_context_projection": self.context_projection.numpy(),
            "head_routing_context_weight": self.context_weight.numpy(),
            "head_routing_token_vectors": self.token_vectors.numpy(),
            "head_routing_token_weight": self.token_weight.numpy(),
            "head_routing_bias": self.bias.numpy(),
            "head_routing_table_scale": self.table_scale.numpy(),
        }

    @staticmethod
    def from_arrays(arrays, num_experts: int, top_k: int) -> "HeadRoutingPredictor":
        return HeadRoutingPredictor(arrays["head_routing_context_projection"], arrays["head_routing_context_weight"],
                                    arrays["head_routing_token_vectors"],
                                    arrays["head_routing_token_weight"], arrays["head_routing_bias"],
                                    arrays["head_routing_table_scale"], num_experts, top_k)


@dataclass(frozen=True)
class NodeRouting:
    """Drafted trees' nodes with the routing their verify pass recorded, flattened over trees."""

    features: torch.Tensor  # [N, D] float32: each node's parent head output (roots: zeros)
    tokens: torch.Tensor  # [N] long
    depths: torch.Tensor  # [N] long
    experts: torch.Tensor  # [L, N, K] long: the experts each node activated in the verify pass
    tree: torch.Tensor  # [N] long: which tree each node belongs to (0, 1, ...; nodes of a tree are contiguous)
    prompt: torch.Tensor  # [N] long: which prompt the tree was drafted for

    def __post_init__(self):
        n = self.tokens.shape[0]
        if (self.features.dim() != 2 or self.features.shape[0] != n or self.depths.shape != (n,)
                or self.experts.dim() != 3 or self.experts.shape[1] != n or self.tree.shape != (n,)
                or self.prompt.shape != (n,)):
            raise ValueError(f"node routing fields disagree on {n} nodes")

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def where(self, keep: torch.Tensor) -> "NodeRouting":
        """The nodes where keep [N] bool holds (whole trees, when it is constant per tree)."""
        return NodeRouting(self.features[keep], self.tokens[keep], self.depths[keep], self.experts[:, keep],
                           self.tree[keep], self.prompt[keep])

    @staticmethod
    def concatenate(parts: Sequence["NodeRouting"]) -> "NodeRouting":
        trees, offset = [], 0
        for part in parts:
            trees.append(part.tree + offset)
            offset += int(part.tree.max()) + 1 if len(part) else 0
        return NodeRouting(torch.cat([p.features for p in parts]), torch.cat([p.tokens for p in parts]),
                           torch.cat([p.depths for p in parts]), torch.cat([p.experts for p in parts], dim=1),
                           torch.cat(trees), torch.cat([p.prompt for p in parts]))


class RoutingSource(str, Enum):
    """Which predictor prices a tree's nodes when their features are carried."""

    HEAD = "head"  # `HeadRoutingPredictor`
    TOKEN_TABLE = "token_table"  # the profile's `TokenExpertTable`


@dataclass(frozen=True)
class HeadRouting:
    """The profile's head routing section: the fitted predictor, which predictor the profile keeps
    (whichever predicted held-out trees' expert unions better), and the held-out scores of both."""

    predictor: HeadRoutingPredictor
    keeps: RoutingSource
    report: dict  # JSON: held-out scores of both predictors, the split, the fit settings

    def __post_init__(self):
        object.__setattr__(self, "keeps", RoutingSource(self.keeps))
        if not isinstance(self.report, dict):
            raise ValueError("a head routing report is a JSON object")

    @property
    def chosen(self) -> bool:
        """The head predictor prices nodes whose features are carried."""
        return self.keeps is RoutingSource.HEAD
