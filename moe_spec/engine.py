"""`SpecDecoder`: tree speculative decoding over a Hugging Face causal LM.

One step, as in EAGLE: the pending token (the root, not yet in the target's cache) and the
drafted tree go through one target forward; acceptance picks the accepted path and the bonus
token; the cache keeps the root and the accepted nodes; the bonus token becomes the next root.
With no drafter every tree is the root alone, which is plain autoregressive decoding through
the same machinery (the `ar` baseline).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from moe_spec.acceptance import Acceptance, accept
from moe_spec.controller import Controller
from moe_spec.drafters.base import Drafter
from moe_spec.errors import DrafterError, InputError
from moe_spec.kv_cache import keep_accepted_path
from moe_spec.sampling import SamplingConfig, probabilities, sample
from moe_spec.stats import GenerationStats, StepStats
from moe_spec.target import TargetModel
from moe_spec.tree import DraftTree, ancestor_mask


@dataclass(frozen=True)
class StepRecord:
    """Everything one step saw, for observers (traces for `simulate`, analysis)."""

    prefix_len: int
    candidates: DraftTree  # what the drafter proposed
    verified: DraftTree  # the subtree the controller chose (== candidates without a controller)
    argmax: torch.Tensor  # [N] long: the target's argmax at each verified node
    experts: torch.Tensor  # [L, N, K] long: routing of the verified nodes
    acceptance: Acceptance
    verify_ms: float
    draft_ms: float


@dataclass
class GenerationResult:
    sequences: torch.Tensor  # [B, T_prompt + T_new] long
    stats: GenerationStats


class SpecDecoder:
    def __init__(
        self,
        target: PreTrainedModel | TargetModel,
        drafter: Drafter | None = None,
        controller: Controller | None = None,
        step_observer: Callable[[StepRecord], None] | None = None,
    ):
        self.target = target if isinstance(target, TargetModel) else TargetModel(target)
        self.drafter = drafter
        self.controller = controller
        self.step_observer = step_observer

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        eos_token_id: int | list[int] | None = None,
        generator: torch.Generator | None = None,
        streamer=None,
    ) -> GenerationResult:
        """Decode up to `max_new_tokens` tokens; greedy when `temperature == 0`.

        `eos_token_id=None` uses the model's generation config, as `model.generate` does.
        """
        sampling = SamplingConfig(temperature, top_k, top_p)
        prompt = self._validated_prompt(input_ids, attention_mask, max_new_tokens)
        eos = self._eos_ids(eos_token_id)
        if self.controller is not None:
            self.controller.reset()
        stats = GenerationStats(prompt_tokens=prompt.numel())
        start = time.perf_counter()
        if streamer is not None:
            streamer.put(prompt[None])

        cache = self.target.new_cache()
        n = prompt.numel()
        prefill = self.target.forward_tree(
            cache,
            prompt[None],
            torch.tril(torch.ones(n, n, dtype=torch.bool))[None],
            torch.arange(n)[None],
        )
        root = sample(probabilities(prefill.logits[0, -1], sampling), generator)
        if self.drafter is not None:
            self.drafter.begin(prompt, prefill.features[0])
        stats.prefill_ms = (time.perf_counter() - start) * 1000
        produced = [root]
        if streamer is not None:
            streamer.put(torch.tensor([root]))

        while len(produced) < max_new_tokens and produced[-1] not in eos:
            new_tokens, step = self._step(cache, root, max_new_tokens - len(produced), sampling, generator)
            new_tokens = new_tokens[: max_new_tokens - len(produced)]
            hit_eos = next((i for i, t in enumerate(new_tokens) if t in eos), None)
            if hit_eos is not None:
                new_tokens = new_tokens[: hit_eos + 1]
            produced.extend(new_tokens)
            stats.steps.append(step)
            if streamer is not None:
                streamer.put(torch.tensor(new_tokens))
            root = produced[-1]

        stats.new_tokens = len(produced)
        stats.total_ms = (time.perf_counter() - start) * 1000
        if streamer is not None:
            streamer.end()
        sequences = torch.cat([prompt, torch.tensor(produced, dtype=torch.long)])[None]
        return GenerationResult(sequences=sequences, stats=stats)

    def _step(self, cache, root: int, remaining: int, sampling: SamplingConfig, generator) -> tuple[list[int], StepStats]:
        """One draft-verify-accept step; returns the tokens it produced and its stats."""
        t0 = time.perf_counter()
        candidates, tree = self._draft(root, remaining, sampling, t0)
        t1 = time.perf_counter()
        prefix_len = cache.get_seq_length()
        n = len(tree)
        out = self.target.forward_tree(
            cache,
            tree.tokens[None],
            ancestor_mask(tree)[None],
            (prefix_len + tree.depths)[None],
        )
        t2 = time.perf_counter()
        acceptance = accept(tree, out.logits[0, :n].cpu(), sampling, generator)
        keep_accepted_path(cache, prefix_len, acceptance.path)
        if self.drafter is not None:
            path = torch.tensor(acceptance.path)
            self.drafter.commit(tree.tokens[path], out.features[0, path.to(out.features.device)])
        verify_ms, draft_ms = (t2 - t1) * 1000, (t1 - t0) * 1000
        if self.controller is not None:
            self.controller.feedback(tree, acceptance, verify_ms, draft_ms, out.routing)
        if self.step_observer is not None:
            logits = out.logits[0, :n]
            self.step_observer(StepRecord(prefix_len, candidates, tree, logits.argmax(-1).cpu(),
                                          out.routing.experts, acceptance, verify_ms, draft_ms))
        step = StepStats(
            tree_size=tree.num_drafted,
            accepted_length=acceptance.num_accepted + 1,
            verify_ms=verify_ms,
            draft_ms=draft_ms,
            unique_experts_per_layer=tuple(out.routing.unique_per_layer()),
        )
        return acceptance.new_tokens(tree), step

    def _draft(self, root: int, remaining: int, sampling: SamplingConfig, started: float) -> tuple[DraftTree, DraftTree]:
        """The drafter's candidate tree and the subtree to verify."""
        # a step produces at most depth + 1 tokens, so deeper drafts than remaining - 1 are waste
        if self.drafter is None or remaining <= 1:
            tree = DraftTree.root_only(root)
            return tree, tree
        default = self.drafter.default_budget
        budget = self.controller.candidate_budget(default) if self.controller is not None else default
        budget = budget.capped(remaining - 1)
        if budget.max_nodes == 0 or budget.max_depth == 0:
            tree = DraftTree.root_only(root)
            return tree, tree
        tree = self.drafter.propose(root, budget, sampling)
        if int(tree.tokens[0]) != root:
            raise DrafterError(f"drafter returned a tree rooted at token {int(tree.tokens[0])}, expected {root}")
        bad = (tree.tokens < 0) | (tree.tokens >= self.target.vocab_size)
        if bool(bad.any()):
            raise DrafterError(
                f"drafter proposed token ids outside the target vocabulary [0, {self.target.vocab_size}): "
                f"{tree.tokens[bad].unique().tolist()[:8]}"
            )
        if int(tree.depths.max()) > remaining - 1:
            keep = (tree.depths <= remaining - 1).nonzero().flatten()
            tree = tree.subtree(keep)
        candidates = tree
        if self.controller is not None:
            tree = self.controller.select(tree, (time.perf_counter() - started) * 1000)
        return candidates, tree

    def _validated_prompt(self, input_ids, attention_mask, max_new_tokens: int) -> torch.Tensor:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise InputError("input_ids must be a [B, T] LongTensor")
        if input_ids.shape[0] != 1:
            raise InputError(f"batch size {input_ids.shape[0]} is not supported yet; pass one prompt (B = 1)")
        if max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        prompt = input_ids[0].cpu().long()
        if attention_mask is not None:
            if attention_mask.shape != input_ids.shape:
                raise InputError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape {tuple(input_ids.shape)}")
            keep = attention_mask[0].cpu().bool()
            first = int(keep.long().argmax()) if bool(keep.any()) else keep.numel()
            if not bool(keep[first:].all()):
                raise InputError("attention_mask must be left padding only (zeros before the prompt, ones after)")
            prompt = prompt[keep]
        if prompt.numel() == 0:
            raise InputError("the prompt is empty; give at least one token")
        if bool(((prompt < 0) | (prompt >= self.target.vocab_size)).any()):
            raise InputError(f"prompt has token ids outside the target vocabulary [0, {self.target.vocab_size})")
        limit = self.target.max_positions
        if limit is not None and prompt.numel() + max_new_tokens > limit:
            raise InputError(
                f"prompt ({prompt.numel()} tokens) plus max_new_tokens ({max_new_tokens}) exceeds the model's "
                f"context of {limit} positions"
            )
        return prompt

    def _eos_ids(self, eos_token_id) -> set[int]:
        if eos_token_id is None:
            generation_config = getattr(self.target.model, "generation_config", None)
            eos_token_id = getattr(generation_config, "eos_token_id", None)
        if eos_token_id is None:
            return set()
        return {int(eos_token_id)} if isinstance(eos_token_id, int) else {int(t) for t in eos_token_id}
