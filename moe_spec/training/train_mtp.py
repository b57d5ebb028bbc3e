"""Train a multi-token-prediction (MTP) layer for a target by self-distillation, as the EAGLE head is
trained (`train_draft`): corpus windows continued by the target, a logit-level loss against the
target's next-token distribution (here over the full vocabulary: an MTP layer drafts with the
target's own output layer), summed over a K-pass training-time test weighted `decay ** k`.

The layer is transformers' `MtpLayer` for the target's architecture (`MtpModel(target, 1)`: `enorm`,
`hnorm`, `eh_proj`, a full MoE decoder layer, `post_norm`), its decoder block started from a copy of
the target's last layer and `eh_proj` from the identity on the state half. Pass 0 reads, for pair t,
token x_{t+1} and the target's last state at position t after its final norm (what transformers feeds
MTP layers); pass k reads token x_{t+1+k} and pass k - 1's output at pair t, as a tree node at depth
k reads its parent's (the same layer: depth k runs layer k mod 1). Pass k's queries see pass 0's
keys causally and pass j's (1 <= j <= k) at their own pair only: the keys a drafted node sees.
Attention runs through transformers' own modules with that 4D mask over a `DynamicCache` holding
the passes' keys side by side.

Written into the target's checkpoint as `model.layers.{N}.*` (`save_mtp_layers`), where
`--drafter mtp` (and transformers' `MtpModel.from_pretrained`) finds it.

    moe-spec train-draft --kind mtp --target moe_spec/assets/default_target --out runs/default_target_mtp --steps 600
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
from accelerate import Accelerator
from torch import nn
from tqdm import tqdm
from transformers import DynamicCache

from moe_spec.core.target import AFTER_FINAL_NORM, TargetModel
from moe_spec.drafters.mtp_layers import checkpoint_files, new_mtp_layers, save_mtp_layers
from moe_spec.training.train_draft import DraftTrainSettings, TokenData, _Batches, lr_at, target_pass

MTP_META_FILE = "moe_spec_mtp_meta.json"


def _ttt_mask(n: int, passes: int, dtype: torch.dtype, device) -> torch.Tensor:
    """[1, 1, n, passes * n] additive mask of the last pass's queries over every pass's keys (pass 0
    causal, later passes their own pair only)."""
    t = torch.arange(n, device=device)
    blocks = [t[None] <= t[:, None]] + [torch.eye(n, dtype=torch.bool, device=device)] * (passes - 1)
    visible = torch.cat(blocks, dim=1)  # [n, passes * n]
    mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, torch.finfo(dtype).min)
    return mask[None, None]


class MtpDistillLoss(nn.Module):
    """The training step's forward: the MTP layer unrolled K passes, logit-level loss against the target."""

    def __init__(self, mtp, ttt_steps: int, ttt_decay: float):
        super().__init__()
        self.mtp = mtp
        self.ttt_steps = ttt_steps
        self.ttt_decay = ttt_decay

    def forward(self, states: torch.Tensor, token_ids: torch.Tensor, target_logits: torch.Tensor):
        """states [B, T, D] the target's last states (after its final norm); token_ids [B, T];
        target_logits [B, T, V]. Returns (weighted loss, per-pass loss [K], per-pass top-1 agreement [K])."""
        mtp = self.mtp
        b, length = token_ids.shape
        n = length - 1  # pairs (state t, token t + 1), t = 0 .. T - 2
        positions = torch.arange(1, n + 1, device=states.device)[None].expand(b, n)  # pair t's token sits at t + 1
        cache = DynamicCache()
        previous = states[:, :n]
        total = states.new_zeros(())
        losses, agreement = [], []
        for k in range(self.ttt_steps):
            m = n - k  # pairs whose pass-k label (target row t + 1 + k) exists
            tokens = token_ids[:, 1 + k: 1 + k + n]  # [B, n - k]: pass k reads x_{t+1+k}
            if tokens.shape[1] < n:  # pad to the sequence so every pass has n columns; padded ones are never read
                tokens = torch.cat([tokens, tokens.new_zeros(b, n - tokens.shape[1])], dim=1)
            embeds = mtp.embed_tokens(tokens)
            position_embeddings = mtp.rotary_emb(embeds, position_ids=positions + k) if mtp.rotary_emb is not None else None
            out = mtp.layers[0](embeds, previous, position_embeddings=position_embeddings,
                                attention_mask=_ttt_mask(n, k + 1, embeds.dtype, embeds.device),
                                position_ids=positions + k, past_key_values=cache)
            logq = torch.log_softmax(mtp._project_to_logits(out[:, :m]).float(), dim=-1)  # [B, m, V]
            target = target_logits[:, 1 + k: 1 + k + m].float()  # [B, m, V]: the target's next-token rows
            p = target.softmax(-1)
            loss = -(p * logq).sum(-1).mean()
            total = total + self.ttt_decay**k * loss
            losses.append(loss.detach())
            agreement.append((logq.argmax(-1) == target.argmax(-1)).float().mean())
            previous = out
        return total, torch.stack(losses), torch.stack(agreement)


def _warm_start(mtp, target: TargetModel) -> None:
    """The MTP block from a copy of the target's last layer, `eh_proj` the identity on the state half,
    the post-norm from the target's final norm."""
    layer = mtp.layers[0]
    with torch.no_grad():
        layer.mtp_block.load_state_dict(target.model.get_decoder().layers[-1].state_dict())
        hidden = layer.eh_proj.weight.shape[0]
        layer.eh_proj.weight.zero_()
        layer.eh_proj.weight[:, hidden:].copy_(torch.eye(hidden))
        layer.eh_proj.weight[:, :hidden].normal_(0.0, 0.02)
        final_norm = getattr(target.model.get_decoder(), "norm", None)
        if layer.post_norm is not None and final_norm is not None:
            layer.post_norm.weight.copy_(final_norm.weight)


def _trainable(mtp) -> list[nn.Parameter]:
    """The MTP layers' own parameters (the embedding and output layer are the target's, frozen)."""
    return [p for name, p in mtp.named_parameters() if name.startswith("layers.") or name.startswith("shared_post_norm")]


def train_mtp(target: TargetModel, target_folder: str | Path, data: TokenData, settings: DraftTrainSettings,
              command: str = "") -> dict:
    """Train one MTP layer for `target` and write the target's checkpoint with it into `settings.out`
    (a copy of `target_folder`'s files, then `save_mtp_layers`); returns the metadata saved beside it."""
    accelerator = Accelerator()
    target.model.eval().requires_grad_(False)
    target.feature_layers = (AFTER_FINAL_NORM,)
    batches = _Batches(target, data.train, settings, accelerator.process_index)
    start = time.monotonic()
    with torch.random.fork_rng():
        torch.manual_seed(settings.seed)
        mtp = new_mtp_layers(target.model, 1, seed=settings.seed).float()
        _warm_start(mtp, target)
        for name, param in mtp.named_parameters():
            param.requires_grad_(name.startswith("layers.") or name.startswith("shared_post_norm"))
        mtp.train()
        step_module = MtpDistillLoss(mtp, settings.ttt_steps, settings.ttt_decay)
        optimizer = torch.optim.AdamW(_trainable(mtp), lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.0)
        step_module, optimizer = accelerator.prepare(step_module, optimizer)
        total = settings.steps or 600
        bar = tqdm(total=total, desc="train-draft --kind mtp", mininterval=10, file=sys.stderr)
        first = running = None
        for step in range(total):
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, total, settings)
            sequences = batches(step)  # [B, T]
            features, target_logits = target_pass(target, sequences)  # [B, T, 1, D], [B, T, V]
            loss, per_pass, agreement = step_module(features[:, :, 0], sequences.to(features.device), target_logits)
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(_trainable(mtp), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            first = per_pass if first is None else first
            running = per_pass if running is None else 0.9 * running + 0.1 * per_pass
            bar.update(1)
            bar.set_postfix(loss=" ".join(f"{x:.2f}" for x in running.tolist()),
                            agree=" ".join(f"{x:.2f}" for x in agreement.tolist()), refresh=False)
        bar.close()
    minutes = (time.monotonic() - start) / 60
    mtp = accelerator.unwrap_model(step_module).mtp.eval()
    evaluation = evaluate_mtp(mtp, target, data.heldout, settings)
    meta = {
        "command": command, "kind": "mtp", "seed": settings.seed, "torch_threads": torch.get_num_threads(),
        "minutes": round(minutes, 2), "steps": total,
        "tokens_seen": total * settings.batch_size * (settings.prompt_len + settings.continuation_len),
        "first_train_loss_per_pass": [round(x, 4) for x in first.tolist()],
        "final_train_loss_per_pass": [round(x, 4) for x in running.tolist()],
        **evaluation, "settings": asdict(settings),
    }
    out = Path(settings.out)
    _copy_checkpoint(Path(target_folder), out)
    save_mtp_layers(mtp, target.model, out, dtype=target_dtype_on_disk(Path(target_folder)))
    (out / MTP_META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return meta


@torch.no_grad()
def evaluate_mtp(mtp, target: TargetModel, heldout: torch.Tensor, settings: DraftTrainSettings) -> dict:
    """Top-1 agreement with the target per depth 1..K on held-out windows continued by the target."""
    batches = _Batches(target, heldout, settings, process=0)
    module = MtpDistillLoss(mtp, settings.ttt_steps, settings.ttt_decay)
    agreement = []
    for i in range(settings.eval_batches):
        sequences = batches(10**6 + i)
        features, target_logits = target_pass(target, sequences)
        agreement.append(module(features[:, :, 0], sequences.to(features.device), target_logits)[2].cpu())
    mean = torch.stack(agreement).mean(0)
    return {"heldout_top1_agreement_by_depth": [round(float(a), 4) for a in mean]}


def target_dtype_on_disk(folder: Path) -> torch.dtype:
    """The dtype the checkpoint's config records (its weights' on disk), float32 when it records none."""
    recorded = json.loads((folder / "config.json").read_text()).get("dtype") or "float32"
    return getattr(torch, str(recorded).removeprefix("torch."), torch.float32)


def _copy_checkpoint(source: Path, out: Path) -> None:
    """`source`'s config, tokenizer and weight files into `out` (nothing when they are the same folder)."""
    if out.resolve() == source.resolve():
        return
    out.mkdir(parents=True, exist_ok=True)
    keep = {p.name for p in checkpoint_files(source)} | {"model.safetensors.index.json"}
    for path in source.iterdir():
        if path.is_file() and (path.suffix == ".json" or path.name in keep) and path.name != MTP_META_FILE:
            shutil.copy2(path, out / path.name)
