"""Train an EAGLE-3 draft head for a target by self-distillation on the fly.

Each step takes B corpus windows, lets the target continue them (half greedy, half sampled at
temperature 1, a few dozen tokens), runs one target forward over prompt + continuation for its
features [B, T, S, D] and logits, and trains the head on a logit-level loss: cross-entropy from the
target's next-token distribution restricted to the draft vocabulary and renormalised (positions
whose target argmax lies outside the draft vocabulary are left out). No feature regression: the
features are inputs only. The loss is summed over a K-pass training-time test (EAGLE-3), pass k
reading the head's own outputs of pass k-1 (`EagleHead.unroll`), weighted `decay ** k`.

The draft vocabulary is the `--draft-vocab` most frequent target tokens, counted over the training
corpus and the target's own continuations (each normalised, equal weight).

    moe-spec train-draft --target runs/default_target/model --out runs/default_draft --minutes 20

Built on `accelerate.Accelerator`, so `accelerate launch -m moe_spec.cli.main train-draft ...` runs
data-parallel; on one CPU it is a plain loop. The command line is `moe_spec/cli/train_draft.py`. Saves the
head in the speculators layout (config.json + model.safetensors, bf16; vLLM serves it with `method:
eagle3`) and moe_spec_meta.json (command, minutes, steps, coverage, held-out agreement with the target).
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast
from torch import nn
from tqdm import tqdm

from moe_spec.drafters.eagle_config import config_for_target
from moe_spec.drafters.eagle_head import EagleHead
from moe_spec.drafters.head_layouts import load_head
from moe_spec.core.target import TargetModel

META_FILE = "moe_spec_meta.json"


@dataclass(frozen=True)
class DraftTrainSettings:
    out: str
    minutes: float = 20.0  # budget when `steps` is None: the step count is calibrated from it
    steps: int | None = None  # fixes the step count (reproduces a run exactly)
    seed: int = 0
    draft_vocab: int = 2048
    head_intermediate: int = 0  # the head's MLP width; 0: 4 x hidden (a smaller head drafts faster)
    # decoder layers in the head: the first reads [embedding, fused features], the rest are plain;
    # None: 1 for a fresh head, the depth of the head in `init`
    head_layers: int | None = None
    aux_layers: tuple[int, ...] | None = None  # target hidden states the head fuses; None: the target's default
    batch_size: int = 8
    prompt_len: int = 96
    continuation_len: int = 32
    sampled_share: float = 0.5  # rows continued by sampling at temperature 1; the rest greedily
    random_prompt_share: float = 0.0  # rows that start from random tokens instead of text (then continue alike)
    repeat_prompt_share: float = 0.0  # rows whose text window is followed by its own start (the target then copies)
    ttt_steps: int = 3  # K passes of the training-time test
    ttt_decay: float = 0.8
    lr: float = 1e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    vocab_batches: int = 4  # target continuations counted into the draft vocabulary
    eval_batches: int = 4
    calibration_steps: int = 5
    init: str | None = None  # a head folder (any layout) to start from: its weights, vocabulary and feature layers

    def __post_init__(self):
        if self.steps is not None and self.steps < 1:
            raise ValueError("steps must be positive")
        if self.head_layers is not None and self.head_layers < 1:
            raise ValueError(f"head_layers must be >= 1, got {self.head_layers}")
        if self.ttt_steps < 1 or self.batch_size < 1 or self.prompt_len < 2 or self.continuation_len < 0:
            raise ValueError(f"invalid settings {self}")
        for name in ("sampled_share", "random_prompt_share", "repeat_prompt_share"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.random_prompt_share + self.repeat_prompt_share > 1.0:
            raise ValueError(f"random_prompt_share + repeat_prompt_share must be at most 1 (each row starts one way), "
                             f"got {self.random_prompt_share} + {self.repeat_prompt_share}")
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr}")


@dataclass(frozen=True)
class TokenData:
    train: torch.Tensor  # [T_train] long: one token stream
    heldout: torch.Tensor  # [T_heldout] long


# ---------------------------------------------------------------------------------------------
# Data: corpus windows continued by the target


def windows(stream: torch.Tensor, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """[B, length] random windows of `stream`."""
    starts = torch.randint(0, len(stream) - length, (batch,), generator=generator)
    return torch.stack([stream[s : s + length] for s in starts.tolist()])


def random_prompts(vocabulary: torch.Tensor, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """[B, length] tokens drawn uniformly from `vocabulary` [V'] (a prompt no text predicts: the
    target's states after it are unlike any a window of text gives, and users send such prompts)."""
    return vocabulary[torch.randint(0, len(vocabulary), (batch, length), generator=generator)]


def repeated_prompts(windows: torch.Tensor) -> torch.Tensor:
    """[B, P] windows -> [B, P]: each window's first 3P/4 tokens, then its first P/4 again, so the
    target's continuation copies the window onward (what a prompt quoting its own earlier text asks
    for, and what the head cannot learn from windows of text, where a repeat is rare)."""
    head = windows.shape[1] - windows.shape[1] // 4
    return torch.cat([windows[:, :head], windows[:, : windows.shape[1] - head]], dim=1)


@torch.no_grad()
def continue_with_target(model, prompts: torch.Tensor, n_new: int, sampled: torch.Tensor,
                         generator: torch.Generator) -> torch.Tensor:
    """[B, P] -> [B, P + n_new]: rows with `sampled` draw at temperature 1, the others take the argmax."""
    device = model.device
    sequences = prompts.to(device)
    out = model(input_ids=sequences, use_cache=True)
    for _ in range(n_new):
        logits = out.logits[:, -1].float().cpu()  # [B, V]
        drawn = torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]
        next_token = torch.where(sampled, drawn, logits.argmax(-1)).to(device)  # [B]
        sequences = torch.cat([sequences, next_token[:, None]], dim=1)
        out = model(input_ids=next_token[:, None], past_key_values=out.past_key_values, use_cache=True)
    return sequences.cpu()


@torch.no_grad()
def target_pass(target: TargetModel, sequences: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] -> (features [B, T, S, D] fp32, logits [B, T, V] fp32)."""
    with target.reading_features() as read:
        out = target.model(input_ids=sequences.to(target.device), use_cache=False, output_hidden_states=True)
        features = read(out)  # [B, T, S, D]
    return features.float(), out.logits.float()


def draft_vocabulary(corpus_counts: torch.Tensor, generated_counts: torch.Tensor, size: int) -> torch.Tensor:
    """[size] target ids, most frequent first (corpus and generated frequencies weighted equally; ties to lower id)."""
    frequency = corpus_counts.double() / corpus_counts.sum().clamp(min=1)
    frequency += generated_counts.double() / generated_counts.sum().clamp(min=1)
    return torch.sort(frequency, descending=True, stable=True).indices[:size].clone()


# ---------------------------------------------------------------------------------------------
# The loss


class DistillLoss(nn.Module):
    """The training step's forward: head unrolled K passes, logit-level loss against the target.

    A module of its own so that `accelerator.prepare` wraps one forward covering every pass.
    """

    def __init__(self, head: EagleHead, ttt_steps: int, ttt_decay: float):
        super().__init__()
        self.head = head
        self.ttt_steps = ttt_steps
        self.ttt_decay = ttt_decay

    def forward(self, features: torch.Tensor, token_embeds: torch.Tensor, target_logits: torch.Tensor):
        """features: [B, T, S, D]; token_embeds: [B, T, D]; target_logits: [B, T, V].

        Returns (weighted loss, per-pass loss [K], per-pass top-1 agreement with the target [K]).
        """
        d2t = self.head.draft_to_target
        next_logits = target_logits[:, 1:]  # [B, n, V]: pair t predicts token t+2, the target's row t+1
        target_top = next_logits.argmax(-1)  # [B, n]
        p = next_logits[..., d2t].softmax(-1)  # [B, n, V_draft] restricted and renormalised
        in_vocab = torch.isin(target_top, d2t)  # [B, n]
        t = torch.arange(p.shape[1], device=p.device)
        total = p.new_zeros(())
        losses, agreement = [], []
        for k, h in enumerate(self.head.unroll(features, token_embeds, self.ttt_steps)):
            logq = torch.log_softmax(self.head.logits(h).float(), dim=-1)  # [B, n, V_draft]
            reached = (t >= k)[None].expand_as(in_vocab)
            valid = in_vocab & reached
            cross_entropy = -(p * logq).sum(-1)  # [B, n]
            loss = (cross_entropy * valid).sum() / valid.sum().clamp(min=1)
            total = total + self.ttt_decay**k * loss
            agree = d2t[logq.argmax(-1)] == target_top
            losses.append(loss.detach())
            agreement.append(agree[reached].float().mean())
        return total, torch.stack(losses), torch.stack(agreement)


# ---------------------------------------------------------------------------------------------
# Training


def lr_at(step: int, total: int, settings: DraftTrainSettings) -> float:
    if step < settings.warmup_steps:
        return settings.lr * (step + 1) / settings.warmup_steps
    progress = min(1.0, (step - settings.warmup_steps) / max(1, total - settings.warmup_steps))
    floor = settings.min_lr_ratio
    return settings.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


class _Batches:
    """Training batches as a pure function of (seed, step, process): windows continued by the target."""

    def __init__(self, target: TargetModel, stream: torch.Tensor, settings: DraftTrainSettings, process: int):
        self.target, self.stream, self.settings, self.process = target, stream, settings, process
        rows = torch.arange(settings.batch_size)  # [B]
        self.sampled = rows < round(settings.sampled_share * settings.batch_size)  # the first rows
        # the last rows start from random tokens (greedy unless the shares overlap)
        random_from = settings.batch_size - round(settings.random_prompt_share * settings.batch_size)
        self.random_rows = rows >= random_from
        # the rows before them repeat their window's start
        self.repeat_rows = (rows < random_from) & (rows >= random_from - round(settings.repeat_prompt_share * settings.batch_size))
        self.vocabulary = torch.unique(stream)  # [V']: the ids text holds, so no special tokens
        self._kept: dict[int, torch.Tensor] = {}

    def __call__(self, step: int, keep: bool = False) -> torch.Tensor:
        if step in self._kept:
            return self._kept.pop(step)
        s = self.settings
        generator = torch.Generator().manual_seed((s.seed * 1_000_003 + step) * 97 + self.process)
        prompts = windows(self.stream, s.batch_size, s.prompt_len, generator)  # [B, P]
        if self.random_rows.any():
            noise = random_prompts(self.vocabulary, int(self.random_rows.sum()), s.prompt_len, generator)
            prompts[self.random_rows] = noise
        if self.repeat_rows.any():
            prompts[self.repeat_rows] = repeated_prompts(prompts[self.repeat_rows])
        sequences = continue_with_target(self.target.model, prompts, s.continuation_len, self.sampled, generator)
        if keep:
            self._kept[step] = sequences
        return sequences


@dataclass(frozen=True)
class _TrainedSteps:
    steps: int
    first_loss: torch.Tensor  # [K] per-pass loss of the first step
    running_loss: torch.Tensor  # [K] running mean of the per-pass loss at the end


def train_draft(target: TargetModel, data: TokenData, settings: DraftTrainSettings, command: str = "") -> dict:
    """Train, evaluate and save a head for `target` into `settings.out`; returns the metadata saved
    beside it (`command`, how the run was started, is recorded in it).

    Randomness is explicit: batches come from per-step generators (`_Batches`), and the head is
    initialised from `settings.seed` inside `torch.random.fork_rng`, so the caller's global RNG is
    left as it was. The thread count is the caller's (the CLI sets it).
    """
    accelerator = Accelerator()
    target.model.eval().requires_grad_(False)
    start_head = _starting_head(target, settings)
    if start_head is not None:
        target.feature_layers = start_head.config.feature_layers_for(target.num_layers)
    elif settings.aux_layers is not None:
        if max(settings.aux_layers) > target.num_layers:
            raise ValueError(f"aux_layers {list(settings.aux_layers)}: the target has hidden states 0..{target.num_layers}")
        target.feature_layers = tuple(sorted(settings.aux_layers))
    if getattr(target.model, "hf_device_map", None) is None:  # a dispatched (offloaded) target stays put
        target.model.to(accelerator.device)
    batches = _Batches(target, data.train, settings, accelerator.process_index)
    start = time.monotonic()
    with torch.random.fork_rng():
        torch.manual_seed(settings.seed)
        # 1) the draft vocabulary; 2) a fresh head and its optimizer; 3) the steps
        if start_head is None:
            d2t = _draft_vocabulary(target, data, batches, settings, accelerator)
            head = EagleHead(config_for_target(target, draft_vocab_size=d2t.numel(),
                                               intermediate_size=settings.head_intermediate,
                                               num_layers=settings.head_layers or 1), d2t).train()
        else:
            head = start_head.train()
        step_module = DistillLoss(head, settings.ttt_steps, settings.ttt_decay)
        optimizer = torch.optim.AdamW(head.parameters(), lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.0)
        step_module, optimizer = accelerator.prepare(step_module, optimizer)
        trained = _train_steps(step_module, optimizer, target, batches, settings, accelerator, start)
    train_minutes = (time.monotonic() - start) / 60

    # 4) evaluate and save
    head = accelerator.unwrap_model(step_module).head.eval()
    evaluation = evaluate(head, target, data.heldout, settings)
    meta = {
        "command": command,
        "target": {"model_type": target.spec.model_type, "vocab_size": target.vocab_size,
                   "hidden_size": int(target.config.hidden_size), "num_hidden_layers": target.num_layers,
                   "aux_layers": list(head.config.aux_layers)},
        "seed": settings.seed,
        "torch_threads": torch.get_num_threads(),
        "minutes": round(train_minutes, 2),
        "steps": trained.steps,
        "tokens_seen": trained.steps * settings.batch_size * (settings.prompt_len + settings.continuation_len),
        "processes": accelerator.num_processes,
        "draft_vocab_size": head.config.draft_vocab,
        "first_train_loss_per_pass": [round(x, 4) for x in trained.first_loss.tolist()],
        "final_train_loss_per_pass": [round(x, 4) for x in trained.running_loss.tolist()],  # running mean
        **evaluation,
        "settings": asdict(settings),
        **({"init": _init_record(settings.init)} if settings.init is not None else {}),
    }
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        head.save_pretrained(settings.out)
        (Path(settings.out) / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def _init_record(init: str) -> dict:
    """Where a head trained further started: its folder and that folder's own metadata (its
    command and settings, and so on back), so the file holds every run that made the head."""
    meta_file = Path(init) / META_FILE
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, ValueError):
        meta = None
    return {"path": str(init), "meta": meta}


def _starting_head(target: TargetModel, settings: DraftTrainSettings) -> EagleHead | None:
    """`settings.init`'s head in fp32, checked against the target and the settings it overrides."""
    if settings.init is None:
        return None
    head = load_head(settings.init, dtype=torch.float32)
    head.check_fits(target)
    layers = head.config.feature_layers_for(target.num_layers)
    if settings.aux_layers is not None and tuple(sorted(settings.aux_layers)) != tuple(layers):
        raise ValueError(f"aux_layers {list(settings.aux_layers)}: the head in init {settings.init} fuses "
                         f"{list(layers)}; a head keeps its feature layers when trained further")
    if settings.head_layers is not None and settings.head_layers != head.config.num_layers:
        raise ValueError(f"head_layers {settings.head_layers}: the head in init {settings.init} has "
                         f"{head.config.num_layers}; a head keeps its depth when trained further")
    if head.embed_tokens is not None:
        head.embed_tokens.requires_grad_(False)
    return head


def _draft_vocabulary(target: TargetModel, data: TokenData, batches: "_Batches", settings: DraftTrainSettings,
                      accelerator: Accelerator) -> torch.Tensor:
    """[V_draft] target ids from corpus counts and the target's own first continuations (kept as
    the first training batches), the same on every process."""
    generated = torch.cat([batches(step, keep=True)[:, settings.prompt_len:].flatten()
                           for step in range(settings.vocab_batches)])
    vocab = target.vocab_size
    d2t = draft_vocabulary(torch.bincount(data.train, minlength=vocab)[:vocab],
                           torch.bincount(generated, minlength=vocab)[:vocab], min(settings.draft_vocab, vocab))
    return broadcast(d2t.to(accelerator.device), from_process=0).cpu()


def _train_steps(step_module, optimizer, target: TargetModel, batches: "_Batches", settings: DraftTrainSettings,
                 accelerator: Accelerator, start: float) -> _TrainedSteps:
    """`settings.steps` steps, or as many as the minute budget (counted from `start`) allows."""
    # the head's own embedding where its file has one (frozen, as published), else the target's
    embed = accelerator.unwrap_model(step_module).head.embedding(target.model.get_input_embeddings())
    device = accelerator.device
    total_steps = settings.steps
    bar = tqdm(total=total_steps, desc="train-draft", mininterval=10, file=sys.stderr,
               disable=not accelerator.is_main_process)
    step, calibration_start, running, initial = 0, None, None, None
    while total_steps is None or step < total_steps:
        lr = lr_at(step, total_steps or 10**9, settings)
        for group in optimizer.param_groups:
            group["lr"] = lr
        sequences = batches(step)  # [B, T]
        features, target_logits = target_pass(target, sequences)
        with torch.no_grad():
            token_embeds = embed(sequences.to(target.device)).float()
        loss, per_pass, agreement = step_module(features.to(device), token_embeds.to(device), target_logits.to(device))
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(step_module.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        initial = per_pass if initial is None else initial
        running = per_pass if running is None else 0.9 * running + 0.1 * per_pass
        bar.update(1)
        bar.set_postfix(loss=" ".join(f"{x:.2f}" for x in running.tolist()),
                        agree=" ".join(f"{x:.2f}" for x in agreement.tolist()), refresh=False)
        if total_steps is None:  # turn the minute budget into a step count, the same on every process
            if step == 1:
                calibration_start = time.monotonic()
            elif step == settings.calibration_steps + 1:
                per_step = (time.monotonic() - calibration_start) / settings.calibration_steps
                remaining = settings.minutes * 60 - (time.monotonic() - start) - 2 * per_step * settings.eval_batches
                estimate = torch.tensor(step + max(0, int(remaining / per_step)), device=accelerator.device)
                total_steps = int(broadcast(estimate, from_process=0))
                bar.total = total_steps
    bar.close()
    return _TrainedSteps(step, initial, running)


@torch.no_grad()
def evaluate(head: EagleHead, target: TargetModel, heldout: torch.Tensor, settings: DraftTrainSettings) -> dict:
    """Coverage of held-out tokens by the draft vocabulary, and top-1 agreement with the target per
    depth 1..K on held-out windows continued by the target (teacher-forced: depth k+1 is pass k)."""
    d2t = head.draft_to_target
    in_vocab = torch.zeros(target.vocab_size, dtype=torch.bool)
    in_vocab[d2t.cpu()] = True
    batches = _Batches(target, heldout, settings, process=0)
    loss_module = DistillLoss(head, settings.ttt_steps, settings.ttt_decay)
    agreement, target_top_covered = [], []
    for i in range(settings.eval_batches):
        sequences = batches(10**6 + i)
        features, target_logits = target_pass(target, sequences)
        embeds = head.embedding(target.model.get_input_embeddings())(sequences.to(target.device)).float()
        device = head.draft_to_target.device
        agreement.append(loss_module(features.to(device), embeds.to(device), target_logits.to(device))[2].cpu())
        target_top_covered.append(in_vocab[target_logits.argmax(-1).cpu()].float().mean())
    agreement = torch.stack(agreement).mean(0) if agreement else torch.zeros(settings.ttt_steps)
    return {
        "heldout_token_coverage": round(float(in_vocab[heldout].float().mean()), 4),
        "heldout_target_top1_coverage": round(float(torch.stack(target_top_covered).mean()), 4)
        if target_top_covered else None,
        "heldout_top1_agreement_by_depth": [round(float(a), 4) for a in agreement],
    }


# ---------------------------------------------------------------------------------------------
# Loading a target and its text


def load_target(path: str | Path) -> tuple[TargetModel, object]:
    """A `TargetModel` (fp32) and its tokenizer from a local folder (or a run folder holding model/)."""
    from moe_spec.loading import load_target as load_model, load_tokenizer

    return TargetModel(load_model(path)), load_tokenizer(path)


def text_data(tokenizer, prompt_files: list[str] | None, heldout_share: float = 0.05) -> TokenData:
    """Token streams from `prompt_files` (last `heldout_share` held out) or else the corpus' splits."""
    from moe_spec.training.tokenizer_training import encode_documents

    if prompt_files:
        stream = torch.tensor(encode_documents(tokenizer, [Path(p).read_text() for p in prompt_files]))
        cut = int(len(stream) * (1 - heldout_share))
        return TokenData(stream[:cut], stream[cut:])
    from moe_spec.training.corpus import load_corpus

    corpus = load_corpus()
    return TokenData(
        torch.tensor(encode_documents(tokenizer, [f.text for f in corpus.train_files])),
        torch.tensor(encode_documents(tokenizer, [f.text for f in corpus.heldout_files])),
    )
