"""Train a small dense draft model for a target by distillation (`train-draft --kind draft-model`).

A Llama-architecture causal LM with the target's vocabulary (and so its tokenizer), trained on the
same batches as the EAGLE head (corpus windows continued by the target, half greedy, half sampled)
with a logit-level loss: at every position, cross-entropy from the target's next-token distribution.
Teacher-forced on the target's own tokens, as it drafts (a draft model reads tokens only). Saved with
`save_pretrained` beside the target's tokenizer files, so `--drafter PATH` and transformers'
`assistant_model` both load it.

    moe-spec train-draft --kind draft-model --target moe_spec/assets/default_target --out runs/default_draft_model --steps 600
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
from tqdm import tqdm
from transformers import AutoModelForCausalLM, LlamaConfig

from moe_spec.core.target import TargetModel
from moe_spec.training.train_draft import META_FILE, DraftTrainSettings, TokenData, _Batches, lr_at

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def draft_model_config(target: TargetModel, hidden: int, layers: int) -> LlamaConfig:
    """A small Llama of the target's vocabulary and special tokens, `layers` deep and `hidden` wide."""
    heads = max(1, hidden // 32)
    text = target.config
    return LlamaConfig(
        vocab_size=target.vocab_size, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=int(
            getattr(text, "max_position_embeddings", 2048) or 2048),
        tie_word_embeddings=True, bos_token_id=text.bos_token_id, eos_token_id=text.eos_token_id,
        pad_token_id=getattr(text, "pad_token_id", None),
    )


@torch.no_grad()
def _target_logits(target: TargetModel, sequences: torch.Tensor) -> torch.Tensor:
    return target.model(input_ids=sequences.to(target.device), use_cache=False).logits.float()  # [B, T, V]


def _loss(draft, sequences: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy of the draft's next-token distribution from the target's, top-1 agreement)."""
    logq = torch.log_softmax(draft(input_ids=sequences).logits.float(), dim=-1)  # [B, T, V]
    p = target_logits.softmax(-1)
    return -(p * logq).sum(-1).mean(), (logq.argmax(-1) == target_logits.argmax(-1)).float().mean()


def train_draft_model(target: TargetModel, target_folder: str | Path, data: TokenData, settings: DraftTrainSettings,
                      hidden: int = 128, layers: int = 2, command: str = "") -> dict:
    """Train a draft model for `target` and save it (with the target's tokenizer) into `settings.out`."""
    accelerator = Accelerator()
    target.model.eval().requires_grad_(False)
    batches = _Batches(target, data.train, settings, accelerator.process_index)
    start = time.monotonic()
    with torch.random.fork_rng():
        torch.manual_seed(settings.seed)
        draft = AutoModelForCausalLM.from_config(draft_model_config(target, hidden, layers), dtype=torch.float32).train()
        optimizer = torch.optim.AdamW(draft.parameters(), lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.0)
        draft, optimizer = accelerator.prepare(draft, optimizer)
        total = settings.steps or 600
        bar = tqdm(total=total, desc="train-draft --kind draft-model", mininterval=10, file=sys.stderr)
        first = running = None
        for step in range(total):
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, total, settings)
            sequences = batches(step).to(accelerator.device)  # [B, T]
            loss, agreement = _loss(draft, sequences, _target_logits(target, sequences).to(accelerator.device))
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(draft.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            value = float(loss.detach())
            first = value if first is None else first
            running = value if running is None else 0.9 * running + 0.1 * value
            bar.update(1)
            bar.set_postfix(loss=f"{running:.2f}", agree=f"{float(agreement):.2f}", refresh=False)
        bar.close()
    minutes = (time.monotonic() - start) / 60
    draft = accelerator.unwrap_model(draft).eval()
    held = _Batches(target, data.heldout, settings, process=0)
    with torch.no_grad():
        agreement = [float(_loss(draft, s, _target_logits(target, s))[1])
                     for s in (held(10**6 + i) for i in range(settings.eval_batches))]
    meta = {
        "command": command, "kind": "draft-model", "seed": settings.seed, "torch_threads": torch.get_num_threads(),
        "minutes": round(minutes, 2), "steps": total, "hidden_size": hidden, "num_hidden_layers": layers,
        "parameters": sum(p.numel() for p in draft.parameters()),
        "first_train_loss": round(first, 4), "final_train_loss": round(running, 4),
        "heldout_top1_agreement": round(sum(agreement) / max(1, len(agreement)), 4),
        "settings": asdict(settings),
    }
    out = Path(settings.out)
    draft.to(torch.bfloat16).save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (Path(target_folder) / name).is_file():
            shutil.copy2(Path(target_folder) / name, out / name)
    (out / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return meta
