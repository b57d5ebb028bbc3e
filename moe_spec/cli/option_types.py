"""argparse `type=` functions that check a value's kind and range while parsing it.

A bad option is then named by argparse on the command line ("argument --top-p: top_p must be a
number in (0, 1], got 1.5") and by `ConfigError` from a config file, before a command loads a
model. The sampling options reuse `SamplingConfig`'s own check, so there is one rule for each.
"""

from __future__ import annotations

import argparse
import math

import torch

from moe_spec.core.sampling import SamplingConfig
from moe_spec.errors import InputError

SEED_LIMIT = 2**32  # torch seeds up to 2**64, but the bench derives per-prompt seeds from this one


def positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def seed(text: str) -> int:
    value = _int(text)
    if not 0 <= value < SEED_LIMIT:
        raise argparse.ArgumentTypeError(f"expected a seed in [0, 2**32), got {text!r}")
    return value


def positive_float(text: str) -> float:
    value = _float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    value = _float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def fraction(text: str) -> float:
    value = _float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}")
    return value


def temperature(text: str) -> float:
    return _sampling(temperature=_float(text)).temperature


def top_k(text: str) -> int:
    return _sampling(top_k=_int(text)).top_k


def top_p(text: str) -> float:
    return _sampling(top_p=_float(text)).top_p


def device(text: str) -> str:
    """A torch device string that exists on this machine ("cpu", "cuda", "cuda:1", "mps")."""
    try:
        parsed = torch.device(text)
    except (RuntimeError, TypeError) as error:
        raise argparse.ArgumentTypeError(f"not a torch device: {text!r} ({error})") from None
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"{text!r}: CUDA is not available on this machine")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"{text!r}: this machine has {torch.cuda.device_count()} CUDA devices")
    elif parsed.type == "mps" and not torch.backends.mps.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: MPS is not available on this machine")
    return text


def experts_implementation(text: str) -> str:
    """transformers' experts implementations (eager and its ExpertsInterface), or megablocks."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    from moe_spec.core import megablocks_experts

    known = ["eager", *ALL_EXPERTS_FUNCTIONS.keys(), megablocks_experts.NAME]
    if text not in known:
        raise argparse.ArgumentTypeError(f"unknown experts implementation {text!r}; known: {', '.join(known)}")
    return text


def _int(text: str) -> int:
    try:
        return int(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _float(text: str) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _sampling(**setting) -> SamplingConfig:
    try:
        return SamplingConfig(**setting)
    except InputError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


SAMPLING_KEYS = ("temperature", "top_k", "top_p")


def sampling_setting(text: str) -> SamplingConfig:
    """One sampling setting written as comma-separated key=value pairs of temperature, top_k and
    top_p ("temperature=0.7,top_p=0.9"); a key left out keeps `SamplingConfig`'s default."""
    setting = {}
    for pair in [p.strip() for p in str(text).split(",") if p.strip()]:
        key, equals, value = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not equals or key not in SAMPLING_KEYS:
            raise argparse.ArgumentTypeError(
                f"expected key=value pairs of {', '.join(SAMPLING_KEYS)} (e.g. temperature=0.7,top_p=0.9), got {text!r}")
        if key in setting:
            raise argparse.ArgumentTypeError(f"{key} is set twice in {text!r}")
        setting[key] = _int(value.strip()) if key == "top_k" else _float(value.strip())
    if not setting:
        raise argparse.ArgumentTypeError("a sampling setting needs at least one of temperature, top_k, top_p")
    return _sampling(**setting)


def sampling_label(sampling: SamplingConfig) -> str:
    """The setting as `sampling_setting` reads it, defaults left out: "temperature=0.7,top_p=0.9"."""
    parts = [f"temperature={sampling.temperature:g}"]
    if sampling.top_k:
        parts.append(f"top_k={sampling.top_k}")
    if sampling.top_p < 1:
        parts.append(f"top_p={sampling.top_p:g}")
    return ",".join(parts)
