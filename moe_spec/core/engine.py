"""`SpecDecoder`: tree speculative decoding over a Hugging Face causal LM, for one prompt or a batch.

One step, as in EAGLE: each row's pending token (the root, not yet in the target's cache) and
its drafted tree go through one target forward, all rows together; acceptance picks each row's
accepted path and bonus token; the cache keeps each row's root and accepted nodes; the bonus
token becomes the row's next root. With no drafter every tree is the root alone, which is plain
autoregressive decoding through the same machinery (the `ar` baseline). Rows that finish (EOS
or `max_new_tokens`) leave the batch and stop costing compute.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from moe_spec.core.acceptance import Acceptance, accept
from moe_spec.core.batch_layout import compaction, prefill_inputs, step_inputs
from moe_spec.core.control import Controller
from moe_spec.core.drafting import Drafter
from moe_spec.core.drafting import BatchDrafter, batch_drafter
from moe_spec.errors import DrafterError, InputError
from moe_spec.core.kv_cache import gather_columns, keep_accepted_path, select_rows
from moe_spec.core.sampling import SamplingConfig, probabilities, sample
from moe_spec.core.stats import GenerationStats, StepStats
from moe_spec.core.target import TargetModel
from moe_spec.core.tree import DraftTree


@dataclass(frozen=True)
class StepRecord:
    """Everything one row's step saw, for observers (traces for `simulate`, analysis)."""

    row: int
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
    sequences: torch.Tensor  # [B, T_prompt + T_new] long: prompts as given, new tokens, then pad
    stats: GenerationStats


@dataclass
class _Row:
    """One sequence of the batch while it decodes."""

    index: int  # row in the caller's batch
    prompt: torch.Tensor  # [T] long, padding removed
    root: int  # pending token: produced, not yet in the cache
    produced: list[int]

    def remaining(self, max_new_tokens: int) -> int:
        return max_new_tokens - len(self.produced)


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
        """Decode up to `max_new_tokens` tokens per row; greedy when `temperature == 0`.

        A batch is given left-padded with its `attention_mask`. `eos_token_id=None` uses the
        model's generation config, as `model.generate` does.
        """
        sampling = SamplingConfig(temperature, top_k, top_p)
        prompts = self._validated_prompts(input_ids, attention_mask, max_new_tokens, streamer)
        eos = self._eos_ids(eos_token_id)
        pad = self._pad_id(eos)
        drafter = batch_drafter(self.drafter, len(prompts)) if self.drafter is not None else None
        if self.controller is not None:
            self.controller.reset()
        stats = GenerationStats(prompt_tokens=sum(p.numel() for p in prompts))
        start = time.perf_counter()
        if streamer is not None:
            streamer.put(prompts[0][None])

        cache = self.target.new_cache()
        ids, mask, positions, valid = prefill_inputs(prompts, pad)
        prefill = self.target.forward_tree(cache, ids, mask, positions)
        rows = []
        for b, prompt in enumerate(prompts):
            root = sample(probabilities(prefill.logits[b, -1], sampling), generator)
            rows.append(_Row(b, prompt, root, [root]))
        if drafter is not None:
            drafter.begin(prompts, [prefill.features[b, valid[b].to(prefill.features.device)] for b in range(len(prompts))])
        stats.prefill_ms = (time.perf_counter() - start) * 1000
        if streamer is not None:
            streamer.put(torch.tensor([rows[0].root]))

        finished: list[_Row] = []
        while True:
            active = [i for i, r in enumerate(rows) if r.remaining(max_new_tokens) > 0 and r.produced[-1] not in eos]
            finished += [r for i, r in enumerate(rows) if i not in active]
            if not active:
                break
            if len(active) < len(rows):  # finished rows leave the batch
                keep = torch.tensor(active)
                select_rows(cache, keep)
                valid = valid[keep]
                rows = [rows[i] for i in active]
                if drafter is not None:
                    drafter.keep_rows(active)
            new_tokens, valid, step = self._step(cache, valid, rows, drafter, max_new_tokens, sampling, generator)
            for row, tokens in zip(rows, new_tokens):
                tokens = tokens[: row.remaining(max_new_tokens)]
                hit_eos = next((i for i, t in enumerate(tokens) if t in eos), None)
                if hit_eos is not None:
                    tokens = tokens[: hit_eos + 1]
                row.produced.extend(tokens)
                row.root = row.produced[-1]
                if streamer is not None:
                    streamer.put(torch.tensor(tokens))
            stats.steps.append(step)

        stats.new_tokens = sum(len(r.produced) for r in finished)
        stats.new_tokens_per_row = [len(r.produced) for r in sorted(finished, key=lambda r: r.index)]
        stats.total_ms = (time.perf_counter() - start) * 1000
        if streamer is not None:
            streamer.end()
        return GenerationResult(sequences=self._sequences(input_ids, finished, pad), stats=stats)

    def _step(self, cache, valid, rows: list[_Row], drafter: BatchDrafter | None, max_new_tokens: int,
              sampling, generator):
        """One draft-verify-accept step for all rows; returns each row's new tokens, the new valid
        mask [B, P'] and the step's stats."""
        t0 = time.perf_counter()
        candidates = self._draft(rows, drafter, max_new_tokens, sampling)
        trees = candidates
        if self.controller is not None and any(t.num_drafted for t in candidates):
            trees = self.controller.select(candidates, (time.perf_counter() - t0) * 1000)
        t1 = time.perf_counter()
        lengths = valid.sum(1)
        ids, tree_mask, positions = step_inputs(trees, lengths)
        out = self.target.forward_tree(cache, ids, tree_mask, positions, prefix_valid=valid)
        t2 = time.perf_counter()
        width = ids.shape[1]
        logits = out.logits.cpu()
        acceptances = [accept(tree, logits[b, : len(tree)], sampling, generator) for b, tree in enumerate(trees)]
        if len(rows) == 1:  # keep the single-row cache dense: crop or index-select the path
            keep_accepted_path(cache, valid.shape[1], acceptances[0].path)
            valid = torch.cat([valid, torch.ones(1, len(acceptances[0].path), dtype=torch.bool)], dim=1)
        else:
            index, valid = compaction(valid, width, [a.path for a in acceptances])
            gather_columns(cache, index)
        verify_ms, draft_ms = (t2 - t1) * 1000, (t1 - t0) * 1000
        row_routing = []  # each row's own nodes' routing, for whoever reads it
        if self.controller is not None or self.step_observer is not None:
            row_routing = [out.routing.select(b * width + torch.arange(len(tree))) for b, tree in enumerate(trees)]
        if drafter is not None:
            paths = [torch.tensor(a.path) for a in acceptances]
            drafter.commit([tree.tokens[path] for tree, path in zip(trees, paths)],
                           [out.features[b, path.to(out.features.device)] for b, path in enumerate(paths)])
        for b, (row, tree, acceptance) in enumerate(zip(rows, trees, acceptances)):
            if self.step_observer is not None:
                self.step_observer(StepRecord(row.index, int(lengths[b]), candidates[b], tree, logits[b, : len(tree)].argmax(-1),
                                              row_routing[b].experts, acceptance, verify_ms, draft_ms))
        if self.controller is not None:
            self.controller.feedback(trees, acceptances, verify_ms, draft_ms, row_routing)
        step = StepStats(
            tree_size=sum(t.num_drafted for t in trees),
            accepted_length=sum(a.num_accepted + 1 for a in acceptances),
            verify_ms=verify_ms,
            draft_ms=draft_ms,
            unique_experts_per_layer=tuple(out.routing.unique_per_layer()),
            rows=len(rows),
            verified_tokens=int(ids.numel()),
            overhead_ms=(time.perf_counter() - t2) * 1000,
        )
        return [a.new_tokens(t) for a, t in zip(acceptances, trees)], valid, step

    def _draft(self, rows: list[_Row], drafter: BatchDrafter | None, max_new_tokens: int,
               sampling: SamplingConfig) -> list[DraftTree]:
        """Each row's candidate tree (the root alone when not drafting), checked."""
        # a step produces at most depth + 1 tokens, so deeper drafts than remaining - 1 are waste
        depths = [row.remaining(max_new_tokens) - 1 for row in rows]
        if drafter is None or max(depths) <= 0:
            return [DraftTree.root_only(row.root) for row in rows]
        default = drafter.default_budget
        budget = self.controller.candidate_budget(default) if self.controller is not None else default
        if budget.max_nodes == 0 or budget.max_depth == 0:
            return [DraftTree.root_only(row.root) for row in rows]
        trees = drafter.propose([row.root for row in rows], budget, depths, sampling)
        for row, tree in zip(rows, trees):
            self._check_tree(row, tree)
        return [tree if int(tree.depths.max()) <= depth else tree.subtree((tree.depths <= depth).nonzero().flatten())
                for tree, depth in zip(trees, depths)]

    def _check_tree(self, row: _Row, tree: DraftTree) -> None:
        if int(tree.tokens[0]) != row.root:
            raise DrafterError(f"drafter returned a tree rooted at token {int(tree.tokens[0])}, expected {row.root}")
        bad = (tree.tokens < 0) | (tree.tokens >= self.target.vocab_size)
        if bool(bad.any()):
            raise DrafterError(
                f"drafter proposed token ids outside the target vocabulary [0, {self.target.vocab_size}): "
                f"{tree.tokens[bad].unique().tolist()[:8]}"
            )

    def _validated_prompts(self, input_ids, attention_mask, max_new_tokens: int, streamer) -> list[torch.Tensor]:
        """Each row's prompt without its padding, after checking everything about the input."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise InputError("input_ids must be a [B, T] LongTensor")
        if input_ids.shape[0] == 0:
            raise InputError("the batch is empty")
        if max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if streamer is not None and input_ids.shape[0] > 1:
            raise InputError("a streamer needs a single prompt (B = 1)")
        ids = input_ids.cpu().long()
        if attention_mask is None:
            mask = torch.ones_like(ids, dtype=torch.bool)
        else:
            if attention_mask.shape != input_ids.shape:
                raise InputError(
                    f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape {tuple(input_ids.shape)}"
                )
            mask = attention_mask.cpu().bool()
        prompts = []
        for b in range(ids.shape[0]):
            keep = mask[b]
            if not bool(keep.any()):
                raise InputError(f"row {b} of the batch is empty (its attention_mask is all zeros)")
            first = int(keep.long().argmax())
            if not bool(keep[first:].all()):
                raise InputError(f"row {b}: attention_mask must be left padding (zeros before the prompt, ones after)")
            prompt = ids[b][keep]
            if bool(((prompt < 0) | (prompt >= self.target.vocab_size)).any()):
                raise InputError(f"row {b}: prompt has token ids outside the target vocabulary [0, {self.target.vocab_size})")
            limit = self.target.max_positions
            if limit is not None and prompt.numel() + max_new_tokens > limit:
                raise InputError(
                    f"row {b}: prompt ({prompt.numel()} tokens) plus max_new_tokens ({max_new_tokens}) exceeds the "
                    f"model's context of {limit} positions"
                )
            prompts.append(prompt)
        if ids.shape[1] == 0:
            raise InputError("the prompt is empty; give at least one token")
        return prompts

    def _sequences(self, input_ids: torch.Tensor, rows: list[_Row], pad: int) -> torch.Tensor:
        """[B, T + longest output]: each row's input as given, its new tokens, then `pad`."""
        rows = sorted(rows, key=lambda r: r.index)
        longest = max(len(r.produced) for r in rows)
        new = torch.full((len(rows), longest), pad, dtype=torch.long)
        for r in rows:
            new[r.index, : len(r.produced)] = torch.tensor(r.produced)
        return torch.cat([input_ids.cpu().long(), new], dim=1)

    def _eos_ids(self, eos_token_id) -> set[int]:
        if eos_token_id is None:
            generation_config = getattr(self.target.model, "generation_config", None)
            eos_token_id = getattr(generation_config, "eos_token_id", None)
        if eos_token_id is None:
            return set()
        return {int(eos_token_id)} if isinstance(eos_token_id, int) else {int(t) for t in eos_token_id}

    def _pad_id(self, eos: set[int]) -> int:
        generation_config = getattr(self.target.model, "generation_config", None)
        pad = getattr(generation_config, "pad_token_id", None)
        if pad is None:
            pad = min(eos) if eos else 0
        return int(pad)
