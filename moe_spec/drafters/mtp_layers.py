"""A checkpoint's own multi-token-prediction (MTP) layers, loaded and written as transformers has them.

DeepSeek-V3/R1 and GLM-4.5/4.6 ship MTP layers as extra decoder layers after the last one, in the
same checkpoint: `model.layers.{N + k}.*` for an N-layer model, holding `enorm`, `hnorm`, `eh_proj`,
`shared_head.norm` and a full (MoE) decoder layer; the config counts them
(`num_nextn_predict_layers`, which transformers reads as `num_mtp_layers`). transformers 5.23 builds
them as `MtpModel` / `MtpLayer` (`transformers/modeling_layers.py`) and loads them with
`MtpModel.from_pretrained(main_model)`.

That loader finds the layers by the patterns the model class declares in
`_keys_to_ignore_on_load_unexpected`, which name the published depths (`model.layers.61` for
DeepSeek-V3, 46 and 92 for GLM-4.5): a checkpoint of any other depth (every small one, the embedded
target included) is not found. `mtp_loading_patterns` gives the patterns of this checkpoint's own
depth, and `load_mtp_layers` passes them to transformers' loader for the one call; the same
instance setting (`model._keys_to_ignore_on_load_unexpected = mtp_loading_patterns(model)`) makes
transformers' own `generate(use_mtp=True)` find them.

`save_mtp_layers` writes an `MtpModel`'s weights into a checkpoint folder in that layout (the decoder
block's tensors named as the model class saves its own layers), and sets the config's count.
"""

from __future__ import annotations

import json
import re
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, PreTrainedModel

from moe_spec.errors import InputError

# the config fields that count MTP layers, transformers' name first
_COUNT_FIELDS = ("num_mtp_layers", "num_nextn_predict_layers")
_EXTRA_KEYS = ("enorm", "hnorm", "eh_proj", "shared_head.norm")  # per MTP layer, beside its decoder block


def mtp_layer_count(model_or_config) -> int:
    """How many MTP layers a model's (or a config's) text config declares (0: none)."""
    config = getattr(model_or_config, "config", model_or_config)
    text = config.get_text_config(decoder=True)
    for name in _COUNT_FIELDS:
        value = getattr(text, name, None)
        if value is not None:
            return int(value)
    return 0


def mtp_loading_patterns(model_or_config) -> list[str]:
    """The checkpoint key patterns of a model's own MTP layers (`model.layers.{N + k}.`)."""
    config = getattr(model_or_config, "config", model_or_config)
    n = int(config.get_text_config(decoder=True).num_hidden_layers)
    return [rf"model\.layers\.{n + k}\..*" for k in range(mtp_layer_count(config))]


@contextmanager
def main_model_skipping_mtp_layers(model_class, config):
    """While loading a `model_class` checkpoint of `config`, its own MTP layers' tensors are known
    extras (the class declares only the published depths), neither loaded nor reported."""
    own = mtp_loading_patterns(config)
    before = model_class.__dict__.get("_keys_to_ignore_on_load_unexpected")
    inherited = getattr(model_class, "_keys_to_ignore_on_load_unexpected", None) or []
    if own:
        model_class._keys_to_ignore_on_load_unexpected = list(inherited) + own
    try:
        yield
    finally:
        if own:
            if before is None:
                del model_class._keys_to_ignore_on_load_unexpected
            else:
                model_class._keys_to_ignore_on_load_unexpected = before


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder (sharded or not)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return sorted({folder / name for name in json.loads(index.read_text())["weight_map"].values()})
    return sorted(folder.glob("*.safetensors"))


def _stored_mtp_layers(folder: Path, num_layers: int) -> set[int]:
    """Layer indices >= num_layers with tensors in the checkpoint's files."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        keys = list(json.loads(index.read_text())["weight_map"])
    else:
        keys = []
        for file in checkpoint_files(folder):
            with safe_open(str(file), "pt") as f:
                keys.extend(f.keys())
    pattern = re.compile(r"^model\.layers\.(\d+)\.")
    return {int(m.group(1)) for m in map(pattern.match, keys) if m and int(m.group(1)) >= num_layers}


def check_mtp_layers(model: PreTrainedModel) -> int:
    """The number of MTP layers `model`'s checkpoint holds; an `InputError` naming what is missing
    where the config declares none or its folder does not hold them."""
    count = mtp_layer_count(model)
    name = type(model).__name__
    if count <= 0:
        raise InputError(f"--drafter mtp: {name} has no MTP layers (its config sets no num_nextn_predict_layers / "
                         "num_mtp_layers); draft with a head folder, a draft model or lookup instead")
    if getattr(model.get_decoder(), "layers", None) is None:
        raise InputError(f"--drafter mtp: {name} has no decoder layers to build MTP layers from")
    folder = Path(str(getattr(model.config, "_name_or_path", "") or model.config.name_or_path or ""))
    if not folder.is_dir():
        raise InputError(f"--drafter mtp: the MTP weights are read from the model's checkpoint folder, and "
                         f"{str(folder)!r} is not a local folder")
    n = int(model.config.get_text_config(decoder=True).num_hidden_layers)
    stored = _stored_mtp_layers(folder, n)
    wanted = set(range(n, n + count))
    if not wanted <= stored:
        missing = ", ".join(f"model.layers.{i}.*" for i in sorted(wanted - stored))
        raise InputError(f"--drafter mtp: the config of {folder} declares {count} MTP layer(s) but the checkpoint "
                         f"has no {missing} tensors (a checkpoint saved without its MTP layers)")
    return count


@contextmanager
def _own_mtp_patterns(model: PreTrainedModel):
    """`model` declares its own checkpoint's MTP key patterns for the duration (instance attribute)."""
    had = "_keys_to_ignore_on_load_unexpected" in vars(model)
    before = vars(model).get("_keys_to_ignore_on_load_unexpected")
    model._keys_to_ignore_on_load_unexpected = mtp_loading_patterns(model)
    try:
        yield
    finally:
        if had:
            model._keys_to_ignore_on_load_unexpected = before
        else:
            del model._keys_to_ignore_on_load_unexpected


def load_mtp_layers(model: PreTrainedModel):
    """transformers' `MtpModel` of `model`'s checkpoint, on the device and in the dtype of its last
    layer, in eval mode (embedding, output layer and rotary tables shared with `model`)."""
    from transformers.modeling_layers import MtpModel

    check_mtp_layers(model)
    last = next(model.get_decoder().layers[-1].parameters())
    with _own_mtp_patterns(model):
        mtp = MtpModel.from_pretrained(model, device_map={"": last.device})
    return mtp.to(last.dtype).eval()


def new_mtp_layers(model: PreTrainedModel, count: int = 1, seed: int = 0):
    """A freshly initialised `MtpModel` with `count` layers for `model` (to train), its decoder blocks
    initialised like `model`'s layers; sets the config's count to `count`."""
    from transformers.modeling_layers import MtpModel

    text = model.config.get_text_config(decoder=True)
    text.num_mtp_layers = count
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        mtp = MtpModel(model, count)
    last = next(model.get_decoder().layers[-1].parameters())
    return mtp.to(device=last.device, dtype=last.dtype)


def _block_keys(model: PreTrainedModel, block: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`block`'s tensors named as `model`'s class saves its layer 0 (`model.layers.0.*`): a one-layer
    model of the same config, carrying `block`'s weights, saved by transformers itself."""
    import tempfile

    config = model.config.get_mtp_config() if hasattr(model.config, "get_mtp_config") else model.config
    config = type(config).from_dict(config.to_dict())
    config.num_hidden_layers = 1
    for name in _COUNT_FIELDS:
        if hasattr(config, name):
            setattr(config, name, 0)
    one = AutoModelForCausalLM.from_config(config, dtype=next(block.parameters()).dtype)
    one.get_decoder().layers[0].load_state_dict(block.state_dict())
    with tempfile.TemporaryDirectory() as tmp:
        one.save_pretrained(tmp)
        tensors = {}
        for file in checkpoint_files(Path(tmp)):
            with safe_open(str(file), "pt") as f:
                for key in f.keys():
                    if key.startswith("model.layers.0."):
                        tensors[key[len("model.layers.0."):]] = f.get_tensor(key)
    return tensors


def save_mtp_layers(mtp, model: PreTrainedModel, folder: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write `mtp`'s layers into the checkpoint in `folder` (which holds `model`'s weights) as
    `model.layers.{N + k}.*` (`_store`), and set `num_nextn_predict_layers` in its config. Returns
    the file written."""
    folder = Path(folder)
    n = int(model.config.get_text_config(decoder=True).num_hidden_layers)
    tensors: dict[str, torch.Tensor] = {}
    for k, layer in enumerate(mtp.layers):
        prefix = f"model.layers.{n + k}."
        for key, value in _block_keys(model, layer.mtp_block).items():
            tensors[prefix + key] = value
        for extra in _EXTRA_KEYS:
            module = layer.post_norm if extra == "shared_head.norm" else getattr(layer, extra)
            tensors[prefix + extra + ".weight"] = module.weight
    tensors = {k: v.detach().to(dtype or v.dtype).contiguous().cpu() for k, v in tensors.items()}
    out = _store(folder, tensors)
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config["num_nextn_predict_layers"] = len(mtp.layers)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def _store(folder: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """Add `tensors` to the checkpoint in `folder` as a shard of their own, listed in the folder's
    `model.safetensors.index.json`. A single-file checkpoint becomes a sharded one: its
    `model.safetensors` is renamed, not rewritten, to `model-00001-of-00002.safetensors` and the
    tensors go to `model-00002-of-00002.safetensors` (transformers reads a single file where there
    is one and would ignore the index beside it, so a stale index from an earlier save is replaced).
    A sharded one gets `mtp_layers.safetensors`.
    Tensors of the same names already listed are replaced. Returns the file written."""
    index_path = folder / "model.safetensors.index.json"
    single = folder / "model.safetensors"
    if index_path.is_file() and not single.is_file():
        index = json.loads(index_path.read_text())
        second = "model-00002-of-00002.safetensors"  # ours when it holds nothing but these tensors (a retrained layer)
        held = {key for key, file in index["weight_map"].items() if file == second}
        out = folder / (second if held and held <= set(tensors) else "mtp_layers.safetensors")
    elif single.is_file():  # loaders read a single file over any index beside it: it is the checkpoint
        first = folder / "model-00001-of-00002.safetensors"
        with safe_open(str(single), "pt") as f:
            index = {"metadata": {}, "weight_map": {key: first.name for key in f.keys()}}
        single.rename(first)
        out = folder / "model-00002-of-00002.safetensors"
    else:
        raise InputError(f"{folder} holds neither model.safetensors nor model.safetensors.index.json to add the MTP layers to")
    save_file(tensors, str(out), metadata={"format": "pt"})
    weight_map = {k: v for k, v in index["weight_map"].items() if v != out.name and k not in tensors}
    weight_map.update({key: out.name for key in tensors})
    index["weight_map"] = dict(sorted(weight_map.items()))
    index_path.write_text(json.dumps(index, indent=2) + "\n")
    return out
