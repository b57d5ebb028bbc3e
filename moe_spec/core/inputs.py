"""Checking what a caller hands `SpecDecoder.generate`, before anything runs.

Every problem is an `InputError` naming the parameter and what is wrong with it; nothing is decoded
(and no state changes) until the whole request has been checked. Sampling settings are checked by
`SamplingConfig` itself.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch

from moe_spec.core.target import TargetModel
from moe_spec.errors import InputError


def left_pad(prompts: Sequence[torch.Tensor], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[1, T_i] prompts -> input_ids [B, T], attention_mask [B, T], left-padded."""
    width = max(p.shape[1] for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - prompt.shape[1]:] = prompt[0]
        mask[row, width - prompt.shape[1]:] = 1
    return ids, mask


def validated_prompts(target: TargetModel, input_ids, attention_mask, max_new_tokens, streamer) -> list[torch.Tensor]:
    """Each row's prompt ([T_b] long) without its left padding."""
    ids = _token_ids(input_ids)  # [B, T] long, on the host
    if not _is_integer(max_new_tokens):
        raise InputError(f"max_new_tokens must be an integer >= 1, got {_describe(max_new_tokens)}")
    if max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if streamer is not None:
        if ids.shape[0] > 1:
            raise InputError("a streamer needs a single prompt (B = 1)")
        if not (callable(getattr(streamer, "put", None)) and callable(getattr(streamer, "end", None))):
            raise InputError(f"streamer must have put(tokens) and end() methods (as TextStreamer), got {_describe(streamer)}")
    mask = torch.ones_like(ids, dtype=torch.bool) if attention_mask is None else _mask(attention_mask, input_ids)
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
            raise InputError(f"row {b}: input_ids has token ids outside the target vocabulary [0, {target.vocab_size})")
        limit = target.max_positions
        if limit is not None and prompt.numel() + max_new_tokens > limit:
            raise InputError(
                f"row {b}: prompt ({prompt.numel()} tokens) plus max_new_tokens ({max_new_tokens}) exceeds the "
                f"model's context of {limit} positions"
            )
        prompts.append(prompt)
    return prompts


def check_generator(generator) -> None:
    """None, or a CPU `torch.Generator`: sampling happens on the host, where the logits are copied."""
    if generator is None:
        return
    if not isinstance(generator, torch.Generator):
        raise InputError(f"generator must be a torch.Generator or None, got {_describe(generator)}")
    if generator.device.type != "cpu":
        raise InputError(f"generator must be a CPU torch.Generator (moe_spec samples on the host), got one on "
                         f"{generator.device}")


def eos_ids(target: TargetModel, eos_token_id) -> set[int]:
    """`eos_token_id` (an id, a list of ids, or a 1-D integer tensor of them), or the model's
    generation config's when None (as `model.generate`); an empty list means no EOS."""
    if eos_token_id is None:
        generation_config = getattr(target.model, "generation_config", None)
        model_eos = getattr(generation_config, "eos_token_id", None)
        if model_eos is None:
            return set()
        return {int(t) for t in torch.as_tensor(model_eos).flatten().tolist()}
    if isinstance(eos_token_id, torch.Tensor):
        if eos_token_id.dim() > 1 or not _integer_dtype(eos_token_id.dtype):
            raise InputError(f"eos_token_id as a tensor must be 0-D or 1-D integer, got {_describe(eos_token_id)}")
        ids = eos_token_id.flatten().tolist()
    elif _is_integer(eos_token_id):
        ids = [eos_token_id]
    elif isinstance(eos_token_id, (list, tuple, set, frozenset)):
        ids = list(eos_token_id)
        bad = [t for t in ids if not _is_integer(t)]
        if bad:
            raise InputError(f"eos_token_id must hold integer token ids, got {_describe(bad[0])} in it")
    else:
        raise InputError(f"eos_token_id must be a token id, a list of them or None, got {_describe(eos_token_id)}")
    outside = sorted({int(t) for t in ids if not 0 <= t < target.vocab_size})
    if outside:
        raise InputError(f"eos_token_id {outside[:8]} outside the target vocabulary [0, {target.vocab_size})")
    return {int(t) for t in ids}


def pad_id(target: TargetModel, eos: set[int]) -> int:
    """The generation config's pad token, else the first EOS id, else 0."""
    generation_config = getattr(target.model, "generation_config", None)
    pad = getattr(generation_config, "pad_token_id", None)
    if pad is None:
        pad = min(eos) if eos else 0
    return int(pad)


def _token_ids(input_ids) -> torch.Tensor:
    """[B, T] long on the host, from an integer tensor with at least one row and one column."""
    if not isinstance(input_ids, torch.Tensor):
        raise InputError(f"input_ids must be a [B, T] integer torch.Tensor, got {_describe(input_ids)}")
    if input_ids.dim() != 2:
        raise InputError(f"input_ids must be a [B, T] integer tensor, got shape {tuple(input_ids.shape)}")
    if not _integer_dtype(input_ids.dtype):
        # a float tensor would be truncated by .long() (5.7 -> 5): refuse it rather than guess
        raise InputError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if input_ids.shape[0] == 0:
        raise InputError("input_ids: the batch is empty (B = 0)")
    if input_ids.shape[1] == 0:
        raise InputError("input_ids: the prompt is empty (T = 0); give at least one token")
    return input_ids.cpu().long()


def _mask(attention_mask, input_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] bool from a 0/1 integer or bool tensor of `input_ids`' shape."""
    if not isinstance(attention_mask, torch.Tensor):
        raise InputError(f"attention_mask must be a [B, T] tensor of 0/1 or None, got {_describe(attention_mask)}")
    if attention_mask.shape != input_ids.shape:
        raise InputError(
            f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape {tuple(input_ids.shape)}"
        )
    if not (_integer_dtype(attention_mask.dtype) or attention_mask.dtype == torch.bool):
        raise InputError(f"attention_mask must be an integer or bool tensor of 0/1, got dtype {attention_mask.dtype}")
    mask = attention_mask.cpu()
    if attention_mask.dtype != torch.bool and bool(((mask != 0) & (mask != 1)).any()):
        values = sorted(set(mask[(mask != 0) & (mask != 1)].unique().tolist()))
        raise InputError(f"attention_mask must hold only 0 and 1, got {values[:8]}")
    return mask.bool()


def _integer_dtype(dtype: torch.dtype) -> bool:
    return dtype != torch.bool and not dtype.is_floating_point and not dtype.is_complex


def _is_integer(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _describe(value) -> str:
    """What a caller passed, briefly: its value when short, else its type."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return f"{text} ({type(value).__name__})" if len(text) <= 40 else f"a {type(value).__name__}"
