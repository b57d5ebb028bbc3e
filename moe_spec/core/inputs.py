"""Checking what a caller hands `SpecDecoder.generate`, before anything runs.

Every problem is an `InputError` naming the parameter; nothing is decoded (and no state changes)
until the whole request has been checked.
"""

from __future__ import annotations

import torch

from moe_spec.core.target import TargetModel
from moe_spec.errors import InputError


def validated_prompts(target: TargetModel, input_ids, attention_mask, max_new_tokens: int, streamer) -> list[torch.Tensor]:
    """Each row's prompt ([T_b] long) without its left padding."""
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
    if ids.shape[1] == 0:
        raise InputError("the prompt is empty; give at least one token")
    prompts = []
    for b in range(ids.shape[0]):
        keep = mask[b]
        if not bool(keep.any()):
            raise InputError(f"row {b} of the batch is empty (its attention_mask is all zeros)")
        first = int(keep.long().argmax())
        if not bool(keep[first:].all()):
            raise InputError(f"row {b}: attention_mask must be left padding (zeros before the prompt, ones after)")
        prompt = ids[b][keep]
        if bool(((prompt < 0) | (prompt >= target.vocab_size)).any()):
            raise InputError(f"row {b}: prompt has token ids outside the target vocabulary [0, {target.vocab_size})")
        limit = target.max_positions
        if limit is not None and prompt.numel() + max_new_tokens > limit:
            raise InputError(
                f"row {b}: prompt ({prompt.numel()} tokens) plus max_new_tokens ({max_new_tokens}) exceeds the "
                f"model's context of {limit} positions"
            )
        prompts.append(prompt)
    return prompts


def eos_ids(target: TargetModel, eos_token_id) -> set[int]:
    """`eos_token_id`, or the model's generation config's when None (as `model.generate`)."""
    if eos_token_id is None:
        generation_config = getattr(target.model, "generation_config", None)
        eos_token_id = getattr(generation_config, "eos_token_id", None)
    if eos_token_id is None:
        return set()
    return {int(eos_token_id)} if isinstance(eos_token_id, int) else {int(t) for t in eos_token_id}


def pad_id(target: TargetModel, eos: set[int]) -> int:
    """The generation config's pad token, else the first EOS id, else 0."""
    generation_config = getattr(target.model, "generation_config", None)
    pad = getattr(generation_config, "pad_token_id", None)
    if pad is None:
        pad = min(eos) if eos else 0
    return int(pad)
