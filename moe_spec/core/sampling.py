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
        logits = logits.masked_fill(nucleus_dropped(logits, config.top_p), float("-inf"))
    return logits.softmax(-1)


def nucleus_dropped(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """[..., V] logits -> [..., V] bool: the tokens top-p filtering drops, as transformers'
    `TopPLogitsWarper` does (the low tail whose mass is at most 1 - top_p; the top token is always
    kept). From the largest few logits when the nucleus ends clearly inside them, else by sorting
    the whole vocabulary: the same mask either way, up to rounding (`NUCLEUS_MARGIN`,
    `_nucleus_dropped_from_top`)."""
    fast = _nucleus_dropped_from_top(logits, top_p)
    return fast if fast is not None else nucleus_dropped_sorted(logits, top_p)


def nucleus_dropped_sorted(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """`nucleus_dropped` by sorting every row's whole vocabulary (transformers' arithmetic)."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
    cumulative = sorted_logits.softmax(-1).cumsum(-1)
    drop_sorted = cumulative <= (1 - top_p)  # token j's ascending cumulative mass includes itself
    drop_sorted[..., -1] = False
    return drop_sorted.scatter(-1, order, drop_sorted)


# how many of the largest logits `_nucleus_dropped_from_top` tries, in turn, before sorting the vocabulary
NUCLEUS_CANDIDATES = (64, 1024)
# how far from top_p every partial mass it decides by must lie. Float32 partial sums of an 8192-token
# distribution typically err by ~1e-6 (their worst-case bound, ~5e-4, is far looser); at this margin
# the two ways agreed wherever the top was used: 512 rows of the embedded target's logits at 20 settings
# of temperature and top_p, and the tests' synthetic sets. A boundary token whose mass above lies
# within rounding of top_p is kept or dropped by rounding in transformers' own warper as well.
NUCLEUS_MARGIN = 1e-5


def _nucleus_dropped_from_top(logits: torch.Tensor, top_p: float) -> torch.Tensor | None:
    """`nucleus_dropped` from the k largest probabilities, or None where that cannot be exact.

    A token is dropped iff the mass of the tokens above it is at least top_p (its ascending
    cumulative mass, itself included, is then at most 1 - top_p). Sorting an 8192-token vocabulary
    costs ~0.4 ms on this CPU, a top-65 ~0.03 ms, and sampling calls this for every node the
    verification walks and every drafted depth. The answer is taken from the top k + 1 only when
    it is the sorted one's: the (k + 1)-th token is dropped, no mass above a candidate lies within
    `NUCLEUS_MARGIN` of top_p (where the two computations' rounding could disagree), and the last
    kept and first dropped tokens differ in probability (a tie could be ordered either way)."""
    vocab = logits.shape[-1]
    rows = logits.reshape(-1, vocab)  # [R, V]
    probs = rows.softmax(-1)
    for k in NUCLEUS_CANDIDATES:
        if k + 1 >= vocab:
            return None
        top, index = probs.topk(k + 1, dim=-1)  # [R, k + 1] descending
        above = top.cumsum(-1) - top  # [R, k + 1] mass of the tokens above each
        if bool((above[:, -1] < top_p + NUCLEUS_MARGIN).any()):
            continue  # the nucleus may reach past the top k: try more
        if bool(((above - top_p).abs() < NUCLEUS_MARGIN).any()):
            return None
        keep = above < top_p  # [R, k + 1], the top token's above is 0
        kept = keep.sum(-1, keepdim=True)  # [R, 1] the nucleus' size, <= k
        last, first_out = top.gather(-1, kept - 1), top.gather(-1, kept)  # [R, 1]
        if bool((last == first_out).any()):
            return None
        drop = torch.ones_like(rows, dtype=torch.bool)
        drop.scatter_(-1, index[:, :k], ~keep[:, :k])
        return drop.view(logits.shape)
    return None


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token id from a [V] distribution (non-negative, not necessarily normalised): the inverse
    of its float64 cumulative distribution at one uniform draw from `generator`. The same law as
    `torch.multinomial(probs, 1)`, at a tenth of its cost over an 8192-token vocabulary on this CPU
    (~0.02 ms against ~0.2: every decoding step samples at least once)."""
    cdf = probs.double().cumsum(0)  # [V]
    total = float(cdf[-1])
    if not total > 0 or not math.isfinite(total):
        raise ValueError(f"cannot sample from a distribution of total mass {total}")
    u = float(torch.rand((), dtype=torch.float64, generator=generator)) * total
    if u < total:  # a token's interval [cdf[i - 1], cdf[i]) is empty when its mass is zero
        return int(torch.searchsorted(cdf, torch.tensor([u], dtype=torch.float64), right=True)[0])
    return int(probs.nonzero()[-1])  # u * total rounded up to the total: the last token of positive mass
