"""An experts implementation backed by megablocks' grouped GEMM, selected like transformers' own.

    load_target(folder, "bfloat16", experts_implementation="megablocks", device="cuda")
    moe-spec bench --experts-implementation megablocks --device cuda ...

transformers 5.23 dispatches every `@use_experts_implementation` experts module through its
`ExpertsInterface`, which a library may extend (`ExpertsInterface.register`). `register()` adds
"megablocks" there when `megablocks` imports (an optional extra: `pip install 'moe_spec[gpu]'`,
a CUDA build matching the installed torch; its grouped GEMM, tgale96's `grouped_gemm`, runs bf16
on CUDA), and raises a clear `InputError` where it does not. Nothing here imports megablocks
until then, so the default install never needs it.

The forward is the grouped-GEMM recipe (Gale et al., 2023, "MegaBlocks"): sort the (token, expert)
pairs by expert, run the up and down projections as one grouped GEMM each over the expert-
contiguous rows, weight each pair by its gate and sum a token's K pairs. `experts_forward(gmm)`
builds it around any `gmm(a, b, batch_sizes, trans_b)` with grouped_gemm's contract, so it is
tested on the CPU against transformers' `grouped_mm` with a loop as `gmm`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moe_spec.errors import InputError

NAME = "megablocks"

# gmm(a [S, in], b [E, out, in] if trans_b else [E, in, out], batch_sizes [E] int64 on the host,
#     trans_b) -> [S, out]: rows of a, expert by expert, times that expert's matrix
GroupedGemm = Callable[..., torch.Tensor]


def megablocks_gmm() -> GroupedGemm:
    """megablocks' grouped GEMM, or an `InputError` saying why it is not available here."""
    try:
        from megablocks import grouped_gemm_util
    except ImportError as error:
        raise InputError(
            f"experts implementation {NAME!r} needs the megablocks package, which is not importable here "
            f"({error}); install the optional extra (pip install 'moe_spec[gpu]', a CUDA build matching "
            f"torch {torch.__version__}) or pick another --experts-implementation (grouped_mm, batched_mm, eager)"
        ) from None
    if not grouped_gemm_util.grouped_gemm_is_available():
        raise InputError(f"experts implementation {NAME!r}: megablocks is installed but its grouped_gemm "
                         "backend is not; install grouped_gemm for this torch and CUDA")
    return grouped_gemm_util.ops.gmm


def register(gmm: GroupedGemm | None = None, name: str = NAME) -> None:
    """Make `name` a valid `experts_implementation` for every transformers model (idempotent)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(name, experts_forward(gmm if gmm is not None else megablocks_gmm()))


def experts_forward(gmm: GroupedGemm):
    """The experts forward transformers calls as `forward(experts, hidden_states, top_k_index, top_k_weights)`."""

    def forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """hidden_states [T, D], top_k_index [T, K], top_k_weights [T, K] -> [T, D]."""
        num_tokens, top_k = top_k_index.shape
        expert_ids, order = torch.sort(top_k_index.reshape(-1))  # [S = T*K] pairs, grouped by expert
        rows = hidden_states[order // top_k].contiguous()  # [S, D]
        # grouped_gemm takes the rows per expert on the host: they reach Python here, once per layer
        # (on CUDA a wait for the router), the price of its host-side GEMM scheduling
        batch_sizes = torch.bincount(expert_ids, minlength=self.num_experts).cpu()  # [E] int64
        trans_b = not self.is_transposed  # HF stores [E, out, in] unless the experts say otherwise
        up_weight = self.gate_up_proj if self.has_gate else self.up_proj
        up = gmm(rows, up_weight.contiguous(), batch_sizes, trans_b=trans_b)  # [S, 2I] or [S, I]
        if self.has_bias:
            up = up + (self.gate_up_proj_bias if self.has_gate else self.up_proj_bias)[expert_ids]
        inner = self._apply_gate(up) if self.has_gate else self.act_fn(up)  # [S, I]
        out = gmm(inner.contiguous(), self.down_proj.contiguous(), batch_sizes, trans_b=trans_b)  # [S, D]
        if self.has_bias:
            out = out + self.down_proj_bias[expert_ids]
        if self.has_post_expert_norm:
            out = self.post_expert_norm(out)
        out = out * top_k_weights.reshape(-1)[order, None].to(out.dtype)
        pairs = torch.empty_like(out)
        pairs[order] = out  # back to (token, k) order; summing the K pairs is deterministic, unlike index_add_
        return pairs.view(num_tokens, top_k, -1).sum(dim=1).to(hidden_states.dtype)

    return forward
