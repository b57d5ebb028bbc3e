"""Loading targets, tokenizers and drafters from local folders (nothing is downloaded)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from moe_spec.core.architectures import SUPPORTED_ARCHITECTURES
from moe_spec.core import megablocks_experts

from moe_spec.errors import InputError

ASSETS = Path(__file__).parent / "assets"
DEFAULT_TARGET = ASSETS / "default_target"
DEFAULT_DRAFTER = ASSETS / "default_draft"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_target(
    path: str | Path | None = None,
    dtype: str = "float32",
    experts_implementation: str | None = "grouped_mm",
    attn_implementation: str | None = None,
    device: str | None = None,
) -> PreTrainedModel:
    """A causal LM from a local folder (default: the embedded target), in eval mode, on `device`
    (None or "cpu": the CPU; else loaded straight onto that device, e.g. "cuda").

    fp32 compute is the default because it ran faster than bf16 at the embedded model's shapes
    on this CPU; `experts_implementation` is not saved in config.json, so it is chosen here
    (transformers' own, or "megablocks" where that package is installed).
    """
    folder = model_folder(path)
    if dtype not in DTYPES:
        raise InputError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if attn_implementation is None:
        spec = SUPPORTED_ARCHITECTURES.get(AutoConfig.from_pretrained(folder).model_type)
        attn_implementation = "eager" if spec is not None and spec.needs_eager_attention else "sdpa"
    kwargs = {"dtype": DTYPES[dtype], "attn_implementation": attn_implementation}
    if device is not None and torch.device(device).type != "cpu":
        kwargs["device_map"] = device
    if experts_implementation == megablocks_experts.NAME:
        megablocks_experts.register()  # transformers' ExpertsInterface knows it from here on
    model = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    if experts_implementation is not None and _has_experts(model):
        model.set_experts_implementation(experts_implementation)
    return model.eval()


def model_folder(path: str | Path | None) -> Path:
    """The folder holding config.json: `path`, its `model/` (a training run folder), or the embedded target."""
    folder = Path(path) if path is not None else DEFAULT_TARGET
    if not (folder / "config.json").is_file() and (folder / "model" / "config.json").is_file():
        folder = folder / "model"
    if not (folder / "config.json").is_file():
        raise InputError(f"no model at {folder} (expected a config.json saved by save_pretrained)")
    return folder


def _has_experts(model: PreTrainedModel) -> bool:
    return bool(getattr(model, "_can_set_experts_implementation", lambda: False)())


def load_tokenizer(path: str | Path | None = None):
    """The tokenizer saved beside a model, or None when the folder has none."""
    folder = model_folder(path)
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    return AutoTokenizer.from_pretrained(folder)


def load_drafter(spec: str | None, target):
    """`None`: no drafter (plain decoding); `lookup`: prompt lookup; anything else: an EAGLE head folder."""
    from moe_spec.drafters.lookup import LookupDrafter

    if spec is None or spec == "none":
        return None
    if spec == "lookup":
        return LookupDrafter()
    from moe_spec.drafters.eagle import EagleDrafter

    folder = DEFAULT_DRAFTER if spec == "default" else Path(spec)
    if not (folder / "config.json").is_file():
        raise InputError(f"no draft head at {folder} (expected config.json + model.safetensors)")
    return EagleDrafter.from_pretrained(folder, target)
