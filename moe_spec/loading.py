"""Loading targets, tokenizers and drafters from local folders (nothing is downloaded)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from moe_spec.core.architectures import SUPPORTED_ARCHITECTURES
from moe_spec.core import megablocks_experts
from moe_spec.drafters.mtp_layers import main_model_skipping_mtp_layers

from moe_spec.errors import InputError
from moe_spec.tensor_file import read_header

ASSETS = Path(__file__).parent / "assets"
DEFAULT_TARGET = ASSETS / "default_target"
DEFAULT_DRAFTER = ASSETS / "default_draft"
DEFAULT_DRAFT_MODEL = ASSETS / "default_draft_model"  # a small dense draft model of the embedded target

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_target(
    path: str | Path | None = None,
    dtype: str = "float32",
    experts_implementation: str | None = "grouped_mm",
    attn_implementation: str | None = None,
    device: str | None = None,
    device_map: str | None = None,
) -> PreTrainedModel:
    """A causal LM from a local folder (default: the embedded target), in eval mode, on `device`
    (None or "cpu": the CPU; else loaded straight onto that device, e.g. "cuda"); `device_map`
    ("auto"): accelerate places it over every GPU, then the CPU, instead.

    fp32 compute is the default because it ran faster than bf16 at the embedded model's shapes
    on this CPU; `experts_implementation` is not saved in config.json, so it is chosen here
    (transformers' own, or "megablocks" where that package is installed).
    """
    folder = model_folder(path)
    if dtype not in DTYPES:
        raise InputError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if attn_implementation is None:
        spec = SUPPORTED_ARCHITECTURES.get(_read_config(folder).model_type)
        attn_implementation = "eager" if spec is not None and spec.needs_eager_attention else "sdpa"
    # safetensors only: a pytorch_model.bin is a pickle, which transformers would otherwise unpickle
    kwargs = {"dtype": DTYPES[dtype], "attn_implementation": attn_implementation, "use_safetensors": True}
    if device_map is not None:
        kwargs["device_map"] = device_map
    elif device is not None and torch.device(device).type != "cpu":
        kwargs["device_map"] = device
    if experts_implementation == megablocks_experts.NAME:
        megablocks_experts.register()  # transformers' ExpertsInterface knows it from here on
    for weights in sorted(folder.glob("*.safetensors")):
        read_header(weights)  # truncated, corrupt or random bytes: named before transformers allocates anything
    try:
        # mismatched sizes are reported in `info` (named below) rather than raised with a pointer to a log
        config = _read_config(folder)
        with main_model_skipping_mtp_layers(_causal_lm_class(config), config):  # a checkpoint's MTP layers load apart
            model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True,
                                                               ignore_mismatched_sizes=True, **kwargs)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as error:  # no weights, wrong shapes, another kind
        raise InputError(f"cannot load a model from {folder}: {_first_line(error)}") from error
    # transformers initialises missing weights at random (a warning only): that would decode garbage
    problems = {kind: sorted(info.get(kind) or ()) for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if any(problems.values()):
        listed = "; ".join(f"{kind.replace('_', ' ')}: {', '.join(_key_name(n) for n in names[:5])}"
                           + (f" and {len(names) - 5} more" if len(names) > 5 else "")
                           for kind, names in problems.items() if names)
        raise InputError(f"the weights in {folder} do not fit its config.json ({listed})")
    if experts_implementation is not None and _has_experts(model):
        model.set_experts_implementation(experts_implementation)
    return model.eval()


def _causal_lm_class(config):
    """The class `AutoModelForCausalLM` builds for `config`."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError as error:
        raise InputError(f"{type(config).__name__} ({config.model_type!r}) is not a causal language model config") from error


def model_folder(path: str | Path | None) -> Path:
    """The folder holding config.json: `path`, its `model/` (a training run folder), or the embedded target."""
    folder = Path(path) if path is not None else DEFAULT_TARGET
    if not (folder / "config.json").is_file() and (folder / "model" / "config.json").is_file():
        folder = folder / "model"
    if not (folder / "config.json").is_file():
        raise InputError(f"no model at {folder} (expected a config.json saved by save_pretrained)")
    return folder


def _read_config(folder: Path):
    """The folder's transformers config; `InputError` naming it when it is not one."""
    try:
        return AutoConfig.from_pretrained(folder)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise InputError(f"{folder / 'config.json'} is not a transformers model config: {_first_line(error)}") from error


def _key_name(entry) -> str:
    """A loading-info entry: a key, or (key, shape in the file, shape the config implies)."""
    if isinstance(entry, tuple) and len(entry) == 3:
        return f"{entry[0]} (file {tuple(entry[1])}, config {tuple(entry[2])})"
    return str(entry)


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:300]


def _has_experts(model: PreTrainedModel) -> bool:
    return bool(getattr(model, "_can_set_experts_implementation", lambda: False)())


def load_tokenizer(path: str | Path | None = None):
    """The tokenizer saved beside a model, or None when the folder has none."""
    folder = model_folder(path)
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    return AutoTokenizer.from_pretrained(folder)


DRAFTER_CHOICES = "lookup, mtp, default (the embedded EAGLE-3 head), none, or a folder holding an EAGLE-3 head or a causal LM"


def drafter_kind(spec: str | None) -> str:
    """What a `--drafter` value names: "none", "lookup", "mtp", "eagle" (a head folder, or the
    embedded "default") or "draft_model" (a causal LM folder), detected from the folder's
    config.json; an `InputError` listing what is accepted for anything else."""
    from moe_spec.drafters.head_layouts import HeadFileError, detect_layout, read_config_file

    if spec is None or spec in ("none", "lookup", "mtp"):
        return spec or "none"
    if spec == "default":
        return "eagle"
    folder = Path(spec)
    if not (folder / "config.json").is_file():
        raise InputError(f"--drafter {spec!r}: not a folder with a config.json; a drafter is {DRAFTER_CHOICES}")
    try:
        detect_layout(read_config_file(folder / "config.json"), folder / "config.json")
        return "eagle"
    except HeadFileError as head_error:
        try:
            config = AutoConfig.from_pretrained(folder)
            _causal_lm_class(config)
        except (OSError, ValueError, KeyError, TypeError, AttributeError, InputError):
            raise InputError(f"--drafter {spec!r}: {folder / 'config.json'} is neither an EAGLE-3 head ({head_error}) nor "
                             f"a causal LM config; a drafter is {DRAFTER_CHOICES}") from None
        return "draft_model"


def load_drafter(spec: str | None, target):
    """The drafter a `--drafter` value names (`drafter_kind`) for `target` (a `TargetModel`):
    None for "none" (plain decoding), prompt lookup, the target's own MTP layers, an EAGLE-3 head
    (a folder in any published layout, or the embedded one) or a draft model (a causal LM folder
    sharing the target's tokenizer, loaded in the target's dtype on its device)."""
    kind = drafter_kind(spec)
    if kind == "none":
        return None
    if kind == "lookup":
        from moe_spec.drafters.lookup import LookupDrafter

        return LookupDrafter()
    if kind == "mtp":
        from moe_spec.drafters.mtp import MtpDrafter

        return MtpDrafter.from_target(target)
    if kind == "eagle":
        from moe_spec.drafters.eagle import EagleDrafter

        return EagleDrafter.from_pretrained(DEFAULT_DRAFTER if spec == "default" else Path(spec), target)
    from moe_spec.drafters.draft_model import DraftModelDrafter

    dtype = str(target.dtype).removeprefix("torch.")
    device = None if target.device.type == "cpu" else str(target.device)
    return DraftModelDrafter(load_target(spec, dtype=dtype, device=device), target)
