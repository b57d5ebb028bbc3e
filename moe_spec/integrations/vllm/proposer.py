"""`MoeSpecProposer`: moe_spec's model-free drafter inside vLLM, chain lengths set per request and per step
by moe_spec's cost model (vLLM's `custom_class` speculative method).

    export MOE_SPEC_PROPOSER=runs/vllm/proposer.json      # written by `moe-spec export-vllm --drafter lookup`
    PYTHONPATH=<moe_spec checkout> vllm serve MODEL --speculative-config \
        '{"method": "custom_class", "model": "moe_spec.integrations.vllm.proposer.MoeSpecProposer",
          "num_speculative_tokens": 5}'

vLLM calls `propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings)` once per step
with every running request's row (vLLM 0.32; token ids only, and no count of tokens to draft: a
custom proposer applies its own schedule). Each step:

1. each request's chain is `LookupDrafter`'s most recent n-gram continuation (up to K =
   `num_speculative_tokens` tokens);
2. its d-th draft is worth r_d = a_1 ... a_d tokens, the per-depth acceptance chains were measured
   to reach at export, updated online by what vLLM accepted of this proposer's own chains
   (`chain_sizing.ChainAcceptance`);
3. the batch's verify pass is priced by the profile's cost model, its experts by each layer's share of
   new experts per token, read from the target's own gates (forward hooks on the router modules of
   the target vLLM hands to `load_model`, the union of the experts each pass routed to);
4. `batch_chain_lengths` keeps the drafts of most tokens per ms over the whole batch.

Every decision can be logged (`MOE_SPEC_PROPOSER_LOG=path`, one JSON line per step) so the lengths can be
checked against the controller offline.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from moe_spec.drafters.lookup import LookupDrafter
from moe_spec.policy.batch_chains import PassCost, batch_chain_lengths, share_from_union
from moe_spec.policy.chain_sizing import ChainAcceptance

CONFIG_ENV = "MOE_SPEC_PROPOSER"
LOG_ENV = "MOE_SPEC_PROPOSER_LOG"


def conditional_from_reach(reach) -> tuple[float, ...]:
    """a_d = R_d / R_{d-1} from the reach R_1..R_K (clamped into [0, 1])."""
    out, previous = [], 1.0
    for r in reach:
        out.append(min(max(r / previous, 0.0), 1.0) if previous > 0 else 0.0)
        previous = r
    return tuple(out)


class MoeSpecProposer:
    def __init__(self, vllm_config=None, config: dict | None = None):
        if config is None:
            path = os.environ.get(CONFIG_ENV)
            if not path:
                raise RuntimeError(f"MoeSpecProposer reads its export from ${CONFIG_ENV} (the proposer.json "
                                   "`moe-spec export-vllm --drafter lookup` writes)")
            config = json.loads(Path(path).read_text())
        spec = getattr(vllm_config, "speculative_config", None)
        self.max_length = int(getattr(spec, "num_speculative_tokens", None) or config["max_length"])
        lookup = config.get("lookup", {})
        self.drafter = LookupDrafter(max_ngram=int(lookup.get("max_ngram", 3)), min_ngram=int(lookup.get("min_ngram", 1)))
        self.acceptance = ChainAcceptance(conditional_from_reach(config["reach"]) or (0.0,))
        cost = config["cost_model"]
        layers = int(cost["num_layers"])
        per_expert = np.asarray(cost["per_expert_ms"], dtype=np.float64)
        self.num_experts = int(config.get("num_experts") or 0)
        self.cost = PassCost(float(cost["base_ms"]), float(cost.get("per_row_ms", 0.0)), float(cost["per_token_ms"]),
                             per_expert if per_expert.size == layers else np.full(layers, float(per_expert[0])),
                             self.num_experts, np.asarray(config.get("new_expert_share") or [0.0] * layers, dtype=np.float64))
        self.draft_per_depth_ms = float(config.get("draft_per_depth_ms", 0.0))
        self._pending: dict[int, tuple[int, int]] = {}  # row -> (tokens before its chain, chain length proposed)
        self._routed: list[tuple[int, np.ndarray]] = []  # per gate call of the last pass: (tokens, experts used)
        self._top_k = int(config.get("top_k") or 0)
        self._log = open(os.environ[LOG_ENV], "a") if os.environ.get(LOG_ENV) else None

    # -- vLLM's interface ----------------------------------------------------------------------

    def load_model(self, model) -> None:
        """Hook the target's routers: each pass's union of routed experts per layer sets q_l."""
        if self.num_experts == 0 or self._top_k == 0:
            return
        for name, module in model.named_modules():
            if name.endswith("mlp.gate"):
                module.register_forward_hook(self._on_gate)

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None, **_) -> list[list[int]]:
        self._learn_routing()
        chains, reach = [], []
        for row, sampled in enumerate(sampled_token_ids):
            length = int(num_tokens_no_spec[row])
            self._observe(row, len(sampled), length)
            if not sampled or length < 2:
                chains.append([])
                reach.append([])
                continue
            history = token_ids_cpu[row, :length].tolist()
            found = self.drafter._continuations(history, self.max_length)
            chain = found[0] if found else []
            chains.append(chain)
            reach.append(self.acceptance.reach(len(chain)))
        lengths = batch_chain_lengths(reach, self.cost, lambda depth: self.draft_per_depth_ms * depth)
        proposals = [chain[:n] for chain, n in zip(chains, lengths)]
        self._pending = {row: (int(num_tokens_no_spec[row]), len(p)) for row, p in enumerate(proposals)}
        if self._log is not None:
            self._log.write(json.dumps({"time": time.time(), "reach": reach, "lengths": lengths,
                                        "share": self.cost.new_expert_share.tolist()}) + "\n")
            self._log.flush()
        return proposals

    # -- online learning -----------------------------------------------------------------------

    def _observe(self, row: int, sampled: int, length: int) -> None:
        """What vLLM accepted of this row's last chain: `sampled` - 1 drafts, if the row is the same request."""
        before = self._pending.get(row)
        if before is None or before[1] == 0 or length - sampled != before[0]:
            return
        accepted = sampled - 1
        self.acceptance.observe([(d, 1.0 if d <= accepted else 0.0) for d in range(1, min(accepted + 1, before[1]) + 1)])

    def _on_gate(self, module, inputs, output) -> None:
        logits = output[0] if isinstance(output, tuple) else output  # [T, E] router logits
        if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.shape[-1] != self.num_experts:
            return
        used = torch.zeros(self.num_experts, dtype=torch.bool)
        used[logits.detach().topk(self._top_k, dim=-1).indices.flatten().cpu()] = True
        self._routed.append((int(logits.shape[0]), used.numpy()))

    def _learn_routing(self) -> None:
        """q_l from the last pass's per-layer unions (layers in call order), blended into the current value."""
        calls, self._routed = self._routed, []
        layers = len(self.cost.new_expert_share)
        if len(calls) < layers:
            return
        last = calls[-layers:]  # the most recent pass
        unique = np.array([used.sum() for _, used in last], dtype=np.float64)
        share = share_from_union(unique, last[0][0], self.num_experts)
        self.cost = replace(self.cost, new_expert_share=0.7 * self.cost.new_expert_share + 0.3 * share)
