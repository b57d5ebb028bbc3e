"""transformers' own decoding loop as reference methods of `bench`: `hf-greedy` and `hf-prompt-lookup`.

Every speedup `bench` quotes is against moe_spec's `ar` (`SpecDecoder` with no drafter); a user
compares with `model.generate`. These two methods run `model.generate` itself on the same prompts,
interleaved with moe_spec's methods, so the report can quote speedups against transformers' loop too:

- `hf-greedy`: `model.generate(do_sample=False)`, or with `temperature > 0`
  `do_sample=True` with the run's temperature / top-k / top-p;
- `hf-prompt-lookup`: the same with `prompt_lookup_num_tokens=PROMPT_LOOKUP_TOKENS`
  (transformers' prompt-lookup decoding, one candidate chain per step; batch size 1 only).

A reference is not a controller: it has no drafter, no tree and no step statistics (its
`GenerationStats.steps` is empty, and the report leaves the per-step figures empty for it). Its
time is the wall time of the `generate` call, prefill included (not split out: `prefill_ms` is 0).
Sampling in transformers draws from torch's global RNG; it is seeded from the run's generator for
the call and restored afterwards, so a sampled reference run is reproducible and leaves the
caller's RNG state as it was.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from moe_spec.core.engine import GenerationResult
from moe_spec.core.inputs import eos_ids, pad_id
from moe_spec.core.sampling import SamplingConfig
from moe_spec.core.stats import GenerationStats
from moe_spec.core.target import TargetModel
from moe_spec.errors import InputError

PROMPT_LOOKUP_TOKENS = 10  # candidate tokens per step, the value transformers' documentation uses


@dataclass(frozen=True)
class HFReference:
    """One of transformers' decoding loops, by the `bench` method name it runs under."""

    name: str
    prompt_lookup_tokens: int | None = None  # None: plain decoding; else `prompt_lookup_num_tokens`

    def decoder(self, target: TargetModel) -> "HFDecoder":
        return HFDecoder(target, self)


REFERENCES: dict[str, HFReference] = {
    ref.name: ref for ref in (HFReference("hf-greedy"), HFReference("hf-prompt-lookup", PROMPT_LOOKUP_TOKENS))
}


class HFDecoder:
    """`model.generate` behind `SpecDecoder.generate`'s signature, so the runner treats both alike."""

    def __init__(self, target: TargetModel, reference: HFReference):
        self.target = target
        self.reference = reference

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,  # [B, T] long, left-padded
        attention_mask: torch.Tensor | None = None,  # [B, T]; None: no padding
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        generator: torch.Generator | None = None,
    ) -> GenerationResult:
        sampling = SamplingConfig(temperature, top_k, top_p)
        if self.reference.prompt_lookup_tokens is not None and input_ids.shape[0] > 1:
            raise InputError(f"{self.reference.name} decodes one sequence at a time (transformers' assisted "
                             f"generation needs batch size 1); run it with --batch-size 1")
        model = self.target.model
        eos = eos_ids(self.target, None)
        pad = pad_id(self.target, eos)
        device = self.target.device
        ids = input_ids.to(device)
        mask = torch.ones_like(ids) if attention_mask is None else attention_mask.to(device)
        kwargs = {"max_new_tokens": max_new_tokens, "min_new_tokens": 0, "pad_token_id": pad,
                  "eos_token_id": sorted(eos) or None}
        if self.reference.prompt_lookup_tokens is not None:
            kwargs["prompt_lookup_num_tokens"] = self.reference.prompt_lookup_tokens
        if sampling.greedy:
            kwargs.update(do_sample=False, temperature=None, top_k=None, top_p=None)
        else:
            # top_k=0 and top_p=1 add no warper in transformers, as in `SamplingConfig`
            kwargs.update(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
        seed = generator.initial_seed() if generator is not None else int(torch.randint(0, 2**62, ()))
        with _global_rng_seeded(seed, device):
            start = time.perf_counter()
            out = model.generate(ids, attention_mask=mask, **kwargs)
            self.target.synchronize()
            total_ms = (time.perf_counter() - start) * 1000
        new = out[:, ids.shape[1]:].cpu()
        per_row = [_produced(row.tolist(), eos) for row in new]
        stats = GenerationStats(prompt_tokens=int(mask.sum()), new_tokens=sum(per_row), total_ms=total_ms,
                                new_tokens_per_row=per_row)
        return GenerationResult(sequences=torch.cat([input_ids.cpu().long(), new], dim=1), stats=stats)


@contextmanager
def _global_rng_seeded(seed: int, device: torch.device):
    """torch's global RNG (the host's and `device`'s) seeded with `seed` inside, restored on exit."""
    accelerator = device.type not in ("cpu", "meta")
    with torch.random.fork_rng(devices=[device] if accelerator else [], device_type=device.type if accelerator else "cuda"):
        torch.manual_seed(seed)
        yield


def _produced(tokens: list[int], eos: set[int]) -> int:
    """New tokens of one row up to and including its first EOS (transformers pads after it)."""
    first = next((i for i, t in enumerate(tokens) if t in eos), None)
    return len(tokens) if first is None else first + 1
