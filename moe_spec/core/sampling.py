"""How a next-token distribution is derived from logits, identically for every method.

Order as in transformers' generate: temperature, then top-k, then top-p. Temperature 0 means
greedy (argmax) decoding.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from moe_spec.errors import InputError

# below this, logits / temperature can overflow float32 (1e-38 already does on a tiny model)
MIN_TEMPERATURE = 1e-6


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0

    def __post_init__(self):
        # checked here, once, so every entry point (generate, the drop-in, the CLI, bench settings)
        # refuses a bad value by name before anything runs, rather than deep inside torch
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise InputError(f"temperature must be a finite number >= 0 (0: greedy), got {self.temperature!r}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise InputError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g} (logits divided by a "
                             f"smaller one overflow float32), got {self.temperature!r}")
        if not _is_integer(self.top_k) or self.top_k < 0:
            raise InputError(f"top_k must be an integer >= 0 (0: no top-k filter), got {self.top_k!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:  # NaN fails the comparison
            raise InputError(f"top_p must be a number in (0, 1], got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _is_real(value) -> bool:
    """A plain real number: int, float or numpy scalar; not a bool, string or tensor."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_integer(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


GREEDY = SamplingConfig()  # temperature 0: argmax decoding


def probabilities(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """[..., V] logits -> [..., V] float32 probabilities after temperature, top-k and top-p.

    For greedy configs this is the one-hot of the argmax.
    """
    logits = logits.float()
    if config.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / config.temperature
    if config.top_k > 0 and config.top_k < logits.shape[-1]:
        kth = torch.topk(logits, config.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if config.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # drop the low tail whose mass is at most 1 - top_p, always keeping the top token
        drop_sorted = cumulative <= (1 - config.top_p)
        drop_sorted[..., -1] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token id from a [V] distribution."""
    return int(torch.multinomial(probs, 1, generator=generator))
