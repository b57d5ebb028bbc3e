"""`SpecDecoder`: tree speculative decoding over a Hugging Face causal LM, for one prompt or a batch.

One step, as in EAGLE: each row's pending token (the root, not yet in the target's cache) and
its drafted tree go through one target forward, all rows together; acceptance picks each row's
accepted path and bonus token; the cache keeps each row's root and accepted nodes; the bonus
token becomes the row's next root. With no drafter every tree is the root alone, which is plain
autoregressive decoding through the same machinery (the `ar` baseline). Rows that finish (EOS
or `max_new_tokens`) leave the batch and stop costing compute.

This is the only decoding loop in moe_spec: the profiler, the calibration data and the traces
that `simulate` replays are all recorded from it, through a `DecodeObserver`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from moe_spec.core.acceptance import accept
from moe_spec.core.blas_threads import single_threaded_blas
from moe_spec.core.batch_layout import prefill_inputs, repack, step_inputs, tail_layout, worth_repacking
from moe_spec.core.control import Controller, StepPlan
from moe_spec.core.drafting import NO_DRAFT, BatchDrafter, Drafter, TreeBudget, batch_drafter
from moe_spec.core.forest import StepForest
from moe_spec.core.inputs import check_generator, eos_ids, pad_id, validated_prompts
from moe_spec.core.kv_cache import gather_columns, keep_tree_paths, select_rows
from moe_spec.core.sampling import SamplingConfig, probabilities, sample
from moe_spec.core.stats import GenerationStats, StepStats
from moe_spec.core.step_record import DecodeObserver, PrefillRecord, StepRecord
from moe_spec.core.target import TargetModel
from moe_spec.core.tree import DraftTree
from moe_spec.errors import DrafterError, MoeSpecError


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
    produced: list[int]  # every new token so far, the root last

    def remaining(self, max_new_tokens: int) -> int:
        return max_new_tokens - len(self.produced)


@dataclass
class _Batch:
    """What the decoding loop carries from step to step."""

    rows: list[_Row]  # the rows still decoding, in cache order
    valid: torch.Tensor  # [B, P] bool: the cache columns holding each row's committed tokens
    budget: TreeBudget  # the candidate tree to draft at the next step


class SpecDecoder:
    def __init__(
        self,
        target: PreTrainedModel | TargetModel,
        drafter: Drafter | BatchDrafter | None = None,
        controller: Controller | None = None,
        observer: DecodeObserver | None = None,
        offload=None,
    ):
        # offload: the `moe_spec.offload.ExpertOffload` installed on `target` (for its step counters)
        fused = getattr(drafter, "feature_layers", None)  # the target states a feature-reading drafter fuses
        if isinstance(target, TargetModel):
            if offload is not None and target.offload is not offload:
                raise MoeSpecError("pass `offload` to the TargetModel, or a plain model with `offload` here, not both")
            if fused is not None and tuple(target.feature_layers) != tuple(fused):
                raise MoeSpecError(
                    f"the drafter fuses feature layers {list(fused)} but the target gives {list(target.feature_layers)}; "
                    "pass the TargetModel the drafter was built on")
            self.target = target
        else:
            self.target = TargetModel(target, feature_layers=tuple(fused) if fused is not None else None, offload=offload)
        self.drafter = drafter
        self.controller = controller
        self.observer = observer

    @torch.no_grad()
    @single_threaded_blas()
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
        model's generation config, as `model.generate` does. numpy's BLAS runs one thread meanwhile
        (see `blas_threads`).
        """
        # 1) check the request before anything runs
        sampling = SamplingConfig(temperature, top_k, top_p)
        prompts = validated_prompts(self.target, input_ids, attention_mask, max_new_tokens, streamer)
        eos = eos_ids(self.target, eos_token_id)
        check_generator(generator)
        pad = pad_id(self.target, eos)
        drafter = batch_drafter(self.drafter, len(prompts)) if self.drafter is not None else None
        budget = drafter.default_budget if drafter is not None else NO_DRAFT
        if self.controller is not None:
            budget = self.controller.begin(budget, sampling)
        stats = GenerationStats(prompt_tokens=sum(p.numel() for p in prompts))
        start = time.perf_counter()
        if streamer is not None:
            streamer.put(prompts[0][None])

        # 2) prefill every prompt in one pass; the first new token of each row is its first root
        cache = self.target.new_cache()
        batch = self._prefill(cache, prompts, pad, sampling, generator, drafter, budget)
        stats.prefill_ms = (time.perf_counter() - start) * 1000
        if streamer is not None:
            streamer.put(torch.tensor([batch.rows[0].root]))

        # 3) draft, plan, verify, accept, until every row is done
        finished: list[_Row] = []
        while True:
            active = [i for i, r in enumerate(batch.rows) if r.remaining(max_new_tokens) > 0 and r.produced[-1] not in eos]
            finished += [r for i, r in enumerate(batch.rows) if i not in active]
            if not active:
                break
            if len(active) < len(batch.rows):  # finished rows leave the batch
                keep = torch.tensor(active)
                select_rows(cache, keep)
                batch.valid = batch.valid[keep]
                batch.valid = _repacked_if_worth_it(cache, batch.valid)  # the rows that left may have been the widest
                batch.rows = [batch.rows[i] for i in active]
                if drafter is not None:
                    drafter.keep_rows(active)
            new_tokens, step = self._step(cache, batch, drafter, max_new_tokens, sampling, generator)
            for row, tokens in zip(batch.rows, new_tokens):
                tokens = tokens[: row.remaining(max_new_tokens)]
                hit_eos = next((i for i, t in enumerate(tokens) if t in eos), None)
                if hit_eos is not None:
                    tokens = tokens[: hit_eos + 1]
                row.produced.extend(tokens)
                row.root = row.produced[-1]
                if streamer is not None:
                    streamer.put(torch.tensor(tokens))
            stats.steps.append(step)

        # 4) the sequences as `model.generate` returns them
        stats.new_tokens = sum(len(r.produced) for r in finished)
        stats.new_tokens_per_row = [len(r.produced) for r in sorted(finished, key=lambda r: r.index)]
        stats.total_ms = (time.perf_counter() - start) * 1000
        if streamer is not None:
            streamer.end()
        return GenerationResult(sequences=_sequences(input_ids, finished, pad), stats=stats)

    def _prefill(self, cache, prompts: list[torch.Tensor], pad: int, sampling: SamplingConfig, generator,
                 drafter: BatchDrafter | None, budget: TreeBudget) -> _Batch:
        ids, mask, positions, valid = prefill_inputs(prompts, pad)
        # the next token needs only the last column's logits (left padding: every row's last token)
        out = self.target.forward_tree(cache, ids, mask, positions, features=drafter is not None, last_logits_only=True)
        # the first roots reach Python here: sampled on the host, where the caller's generator lives
        last = out.logits[:, -1].cpu()  # [B, V]
        rows = []
        for b, prompt in enumerate(prompts):
            root = sample(probabilities(last[b], sampling), generator)
            rows.append(_Row(b, prompt, root, [root]))
        if drafter is not None:
            drafter.begin(prompts, [out.features[b, valid[b].to(out.features.device)] for b in range(len(prompts))])
        if self.observer is not None:
            self.observer.on_prefill(PrefillRecord(tuple(range(len(prompts))), tuple(prompts), out.routing, valid))
        return _Batch(rows, valid, budget)

    def _step(self, cache, batch: _Batch, drafter: BatchDrafter | None, max_new_tokens: int,
              sampling: SamplingConfig, generator) -> tuple[list[list[int]], StepStats]:
        """One draft-plan-verify-accept step for all rows; returns each row's new tokens and the
        step's stats, and moves `batch` (valid columns, next budget) on."""
        rows = batch.rows
        # 1) each row's candidate tree
        t0 = time.perf_counter()
        candidates = self._draft(rows, drafter, batch.budget, max_new_tokens, sampling, generator)
        t1 = time.perf_counter()
        # 2) the plan: which subtree of each to verify, and the next step's candidate budget
        if self.controller is not None:
            plan = self.controller.plan(StepForest(candidates), (t1 - t0) * 1000)
            _check_plan(plan, candidates)
        else:
            plan = StepPlan(StepForest(candidates), batch.budget)
        forest = plan.verify
        t2 = time.perf_counter()
        offload = self.target.offload
        if offload is not None and offload.config.prefetch and plan.expected_experts is not None:
            offload.prefetch(plan.expected_experts())  # read ahead of the layers
        # 3) every row's tree through the target in one forward
        lengths = batch.valid.sum(1)  # [B]
        columns = batch.valid.shape[1]  # the cache's width now (`tail_layout` may have left stale columns)
        ids, tree_mask, positions = step_inputs(forest, lengths)
        out = self.target.forward_tree(cache, ids, tree_mask, positions, prefix_valid=batch.valid,
                                       features=drafter is not None)
        self.target.synchronize()  # an asynchronous device has only queued the pass so far
        t3 = time.perf_counter()
        # 4) acceptance, row by row, on the host: the logits reach Python here, once per step
        logits = out.logits.cpu()  # [B, W, V]
        acceptances = tuple(accept(tree, logits[b, : len(tree)], sampling, generator) for b, tree in enumerate(forest))
        # 5) the cache keeps each row's committed columns plus its accepted path; the drafter learns them
        if forest.width == 1:  # roots alone (plain decoding): every row keeps its one new column as it is
            batch.valid = torch.cat([batch.valid, torch.ones(len(rows), 1, dtype=torch.bool)], dim=1)
        else:  # each row's path moves to the start of the tree's columns (one row: the cache stays dense)
            paths = [a.path for a in acceptances]
            keep_tree_paths(cache, columns, paths)
            batch.valid = tail_layout(batch.valid, paths)
            batch.valid = _repacked_if_worth_it(cache, batch.valid)  # shorter rows' stale columns
        if drafter is not None:
            paths = [torch.tensor(a.path) for a in acceptances]
            drafter.commit([tree.tokens[path] for tree, path in zip(forest, paths)],
                           [out.features[b, path.to(out.features.device)] for b, path in enumerate(paths)])
        batch.budget = plan.next_budget
        t4 = time.perf_counter()
        # 6) the record of the step, for the observer and the controller
        record = StepRecord(
            rows=tuple(r.index for r in rows), prefix_lens=tuple(int(n) for n in lengths), candidates=tuple(candidates),
            verified=forest, acceptances=acceptances, argmax=logits.argmax(-1), routing=out.routing,
            verify_ms=(t3 - t2) * 1000, draft_ms=(t1 - t0) * 1000, plan_ms=(t2 - t1) * 1000, accept_ms=(t4 - t3) * 1000,
            sampling=sampling, logits=None if sampling.greedy else logits, fetch=out.fetch, started=t0,
        )
        if self.observer is not None:
            self.observer.on_step(record)
        if self.controller is not None:
            self.controller.observe(record)
        step = StepStats(
            tree_size=forest.num_drafted,
            accepted_length=record.tokens_produced,
            verify_ms=record.verify_ms,
            draft_ms=record.draft_ms,
            unique_experts_per_layer=tuple(out.routing.unique_per_layer()),
            rows=len(rows),
            verified_tokens=forest.pass_tokens,
            plan_ms=record.plan_ms,
            overhead_ms=(time.perf_counter() - t3) * 1000,
            cache_columns=columns,
            **_fetch_fields(out.fetch),
        )
        return [a.new_tokens(t) for a, t in zip(acceptances, forest)], step

    def _draft(self, rows: list[_Row], drafter: BatchDrafter | None, budget: TreeBudget, max_new_tokens: int,
               sampling: SamplingConfig, generator) -> list[DraftTree]:
        """Each row's candidate tree (the root alone when not drafting), checked."""
        # a step produces at most depth + 1 tokens, so deeper drafts than remaining - 1 are waste
        depths = [row.remaining(max_new_tokens) - 1 for row in rows]
        if drafter is None or max(depths) <= 0 or budget.drafts_nothing:
            return [DraftTree.root_only(row.root) for row in rows]
        trees = drafter.propose([row.root for row in rows], budget, depths, sampling, generator=generator)
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


def _repacked_if_worth_it(cache, valid: torch.Tensor) -> torch.Tensor:
    """`valid` [B, P], or, once its stale columns are worth a copy (`batch_layout.worth_repacking`),
    every row right-aligned again in `cache` and the new valid columns."""
    if not worth_repacking(valid):
        return valid
    index, valid = repack(valid)
    gather_columns(cache, index)
    return valid


def _fetch_fields(fetch) -> dict:
    """StepStats' offload fields from a pass's `FetchCounts` (none when nothing is offloaded)."""
    if fetch is None:
        return {}
    return {"expert_hits": fetch.hits, "expert_misses": fetch.misses, "bytes_read": fetch.bytes_read,
            "fetch_wait_ms": fetch.wait_ms}


def _check_plan(plan: StepPlan, candidates: list[DraftTree]) -> None:
    """A controller's plan verifies one tree per row, each rooted at that row's root."""
    if len(plan.verify) != len(candidates):
        raise MoeSpecError(f"the controller planned {len(plan.verify)} rows for a batch of {len(candidates)}")
    for b, (tree, candidate) in enumerate(zip(plan.verify, candidates)):
        if tree is candidate:  # verified as drafted
            continue
        if int(tree.tokens[0]) != int(candidate.tokens[0]):
            raise MoeSpecError(f"the controller's tree for row {b} is not rooted at the row's root")
        # a cut that looks at what was drawn (scores, tokens, experts) changes the distribution the
        # rejection sampler reproduces; controllers size sampled trees through the next budget
        if candidate.sampled and len(tree) != len(candidate):
            raise MoeSpecError(f"the controller cut row {b}'s sampled candidate tree; sampled candidates are "
                               f"verified as drafted")


def _sequences(input_ids: torch.Tensor, rows: list[_Row], pad: int) -> torch.Tensor:
    """[B, T + longest output]: each row's input as given, its new tokens, then `pad`."""
    rows = sorted(rows, key=lambda r: r.index)
    longest = max(len(r.produced) for r in rows)
    new = torch.full((len(rows), longest), pad, dtype=torch.long)
    for r in rows:
        new[r.index, : len(r.produced)] = torch.tensor(r.produced)
    return torch.cat([input_ids.cpu().long(), new], dim=1)
