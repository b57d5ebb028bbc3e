"""The file layouts of published EAGLE-3 heads: detected, read and written.

One architecture (`EagleHead`), four ways to lay it out on disk, told apart by config.json:

| layout | config.json | layer keys | feature layers |
|---|---|---|---|
| `speculators` (vLLM, Red Hat) | `speculators_model_type: eagle3`, `transformer_layer_config` | `layers.{i}.*` | `eagle_aux_hidden_state_layer_ids`, `hidden_states` indices |
| `specforge` (SGLang) | `LlamaForCausalLMEagle3` with SpecForge's keys (`eagle_config`, `fc_norm`, `norm_output`) | `midlayer.*` | `eagle_config.eagle_aux_hidden_state_layer_ids`, layer *outputs*: id i is `hidden_states[i + 1]` |
| `eagle` (the EAGLE authors) | `LlamaForCausalLMEagle3` (or their template's `LlamaForCausalLM`), Llama fields + `draft_vocab_size` | `midlayer.*` | EAGLE's default |
| `angelslim` (Tencent) | `Eagle3LlamaForCausalLM`, Llama fields + `draft_vocab_size` | `midlayer.*` | EAGLE's default |

Two fields mean different things in different layouts. `norm_output` in speculators (its "Eagle 3.1")
feeds `norm(x)` back to deeper drafts; in SpecForge it says whether `lm_head` reads `norm(x)` (default
true) and the feedback stays pre-norm: each is read as its own code uses it. `norm_before_residual`
absent is false, as speculators, SpecForge and EAGLE build it (vLLM's own translation of a
speculators config defaults it to true, so `moe_spec` always writes it).

Everywhere else they agree: `fc.weight` [H, S Ht], `norm.weight`, `lm_head.weight` [Vd, H], an optional
`embed_tokens.weight` [V, H] (absent: the target's embedding), `d2t` [Vd] int64 offsets (target id =
draft id + d2t[draft id]) and `t2d` [V] bool, both absent where the vocabularies are equal. EAGLE's
default feature layers are `hidden_states[2, N // 2, N - 3]` of an N-layer target, resolved when the
head meets its target. `moe_spec` writes the `eagle` layout with an extra top-level
`eagle_aux_hidden_state_layer_ids` (hidden-state indices) when its layers are not the default: EAGLE's
own code ignores the field.

Everything a folder declares is checked before a weight is allocated: config fields by type, then
the weights file's header against the shapes the config implies (computed on the meta device),
then `d2t` against the vocabulary. Every failure is a `MoeSpecError` naming the file and the field.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from moe_spec.drafters.eagle_config import LAYER_FIELDS, EagleConfig
from moe_spec.drafters.eagle_head import EagleHead
from moe_spec.errors import MoeSpecError
from moe_spec.tensor_file import TensorFileError, read_header, read_tensors

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
LEGACY_WEIGHTS_FILE = "pytorch_model.bin"  # some of the EAGLE authors' heads: a pickle, refused with a conversion hint
SHARD_INDEX_FILE = "model.safetensors.index.json"  # a large head (a big vocabulary) saved in shards
LAYOUTS = ("speculators", "specforge", "eagle", "angelslim")
OLD_MOE_SPEC_KIND = "moe_spec.eagle_head"
_MAX_CONFIG_BYTES = 2**20
_EAGLE_ARCHITECTURE = "LlamaForCausalLMEagle3"
_ANGELSLIM_ARCHITECTURE = "Eagle3LlamaForCausalLM"
_SPECFORGE_KEYS = {"eagle_config", "fc_norm", "norm_output"}  # what only SpecForge's configs carry
SPECULATORS_VERSION = "0.9.0"  # the speculators release whose layout is written (and whose code made the golden tests)


class HeadFileError(MoeSpecError):
    """A draft head folder that cannot be read as any known EAGLE-3 layout."""


# ---------------------------------------------------------------------------------------------
# detecting and reading the config


def read_config_file(path: Path) -> dict:
    if not path.is_file():
        raise HeadFileError(f"{path.parent} has no {path.name}; is it an EAGLE-3 head folder?")
    if path.stat().st_size > _MAX_CONFIG_BYTES:
        raise HeadFileError(f"{path} is {path.stat().st_size} bytes, too large for a draft head config")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise HeadFileError(f"cannot read draft head config {path}: {error}") from None
    if not isinstance(raw, dict):
        raise HeadFileError(f"{path} is not a JSON object (a draft head config is one)")
    return raw


def detect_layout(raw: dict, path: Path) -> str:
    """Which of `LAYOUTS` a config.json is written in."""
    if raw.get("kind") == OLD_MOE_SPEC_KIND:
        raise HeadFileError(f"{path} is a head in the format of moe_spec before EAGLE-3 heads (kind "
                            f"{OLD_MOE_SPEC_KIND!r}), which is no longer read: retrain it with `moe-spec train-draft`")
    if raw.get("speculators_model_type") is not None:
        if raw["speculators_model_type"] != "eagle3":
            raise HeadFileError(f"{path}: speculators_model_type {raw['speculators_model_type']!r} is not an EAGLE-3 "
                                "head (only 'eagle3' is)")
        return "speculators"
    architectures = raw.get("architectures") or []
    if not isinstance(architectures, list):
        raise HeadFileError(f"{path}: architectures must be a list, got {architectures!r}")
    if _EAGLE_ARCHITECTURE in architectures or ("LlamaForCausalLM" in architectures and "draft_vocab_size" in raw):
        return "specforge" if _SPECFORGE_KEYS & set(raw) else "eagle"
    if _ANGELSLIM_ARCHITECTURE in architectures:
        return "angelslim"
    raise HeadFileError(f"{path} is not an EAGLE-3 head config: expected speculators_model_type 'eagle3' or "
                        f"architectures [{_EAGLE_ARCHITECTURE!r}] (EAGLE, SpecForge) or [{_ANGELSLIM_ARCHITECTURE!r}] "
                        f"(AngelSlim), got architectures {architectures!r}")


def _layer_ids(raw: dict, name: str, path: Path, where: str = "") -> tuple[int, ...]:
    """Feature layer ids as a file lists them, in the ascending order every engine captures and fuses
    them in (vLLM, SGLang and EAGLE walk the target's layers once); a layer named twice is refused."""
    ids = _field(raw, name, "ids", path, (), where)
    if len(set(ids)) != len(ids):
        raise HeadFileError(f"{path}: {where}{name} {ids} names a layer twice; engines capture each layer once")
    return tuple(sorted(ids))


def _field(raw: dict, name: str, kind: str, path: Path, default=None, where: str = ""):
    """raw[name] checked as `kind` ('int' >= 1, 'int0' >= 0, 'bool', 'ids', 'float' > 0); default if absent or null."""
    value = raw.get(name)
    if value is None:
        return default
    label = f"{where}{name}"
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if kind == "int" and not (is_int and value >= 1):
        raise HeadFileError(f"{path}: {label} must be an integer >= 1, got {value!r}")
    if kind == "int0" and not (is_int and value >= 0):
        raise HeadFileError(f"{path}: {label} must be an integer >= 0, got {value!r}")
    if kind == "bool" and not isinstance(value, bool):
        raise HeadFileError(f"{path}: {label} must be true or false, got {value!r}")
    if kind == "float" and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                and math.isfinite(value) and value > 0):
        raise HeadFileError(f"{path}: {label} must be a positive number, got {value!r}")
    if kind == "ids" and not (isinstance(value, list) and value and all(
            isinstance(i, int) and not isinstance(i, bool) for i in value)):
        raise HeadFileError(f"{path}: {label} must be a non-empty list of layer ids, got {value!r}")
    return value


def _layer_fields(raw: dict, path: Path, where: str = "") -> dict:
    """The Llama fields of a layer config, each checked for its type."""
    for name in ("hidden_size", "intermediate_size", "num_attention_heads"):
        if raw.get(name) is None:
            raise HeadFileError(f"{path}: {where}{name} is missing")
    for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "max_position_embeddings"):
        _field(raw, name, "int", path, where=where)
    for name in ("rms_norm_eps", "rope_theta"):
        _field(raw, name, "float", path, where=where)
    for name in ("attention_bias", "mlp_bias"):
        _field(raw, name, "bool", path, where=where)
    if raw.get("hidden_act") is not None and not isinstance(raw["hidden_act"], str):
        raise HeadFileError(f"{path}: {where}hidden_act must be a string, got {raw['hidden_act']!r}")
    return {k: v for k, v in raw.items() if k in LAYER_FIELDS and v is not None}


def config_from_raw(raw: dict, layout: str, path: Path) -> EagleConfig:
    """`EagleConfig` from a config.json in `layout`; `HeadFileError` naming the field otherwise."""
    if layout == "speculators":
        layer_raw = raw.get("transformer_layer_config")
        if not isinstance(layer_raw, dict):
            raise HeadFileError(f"{path}: transformer_layer_config must be an object, got {layer_raw!r}")
        where = "transformer_layer_config."
        model_type = layer_raw.get("model_type", "qwen3")  # speculators' own default
        if model_type not in ("llama", "qwen3"):
            raise HeadFileError(f"{path}: {where}model_type {model_type!r} is not a layer this head knows "
                                "('llama' or 'qwen3')")
        vocab = _field(layer_raw, "vocab_size", "int", path, where=where)
        if vocab is None:
            raise HeadFileError(f"{path}: {where}vocab_size (the target's vocabulary) is missing")
        verifier = ((raw.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path") or ""
        fields = dict(
            layer=_layer_fields(layer_raw, path, where), vocab_size=vocab,
            aux_layers=_layer_ids(raw, "eagle_aux_hidden_state_layer_ids", path),
            target_hidden_size=_field(raw, "target_hidden_size", "int", path, 0),
            draft_vocab_size=_field(raw, "draft_vocab_size", "int", path, 0),
            num_layers=_field(layer_raw, "num_hidden_layers", "int", path, 1, where),
            qk_norm=model_type == "qwen3",
            norm_before_residual=_field(raw, "norm_before_residual", "bool", path, False),
            norm_before_fc=_field(raw, "norm_before_fc", "bool", path, False),
            fc_norm=_field(raw, "fc_norm", "bool", path, False),
            norm_output=_field(raw, "norm_output", "bool", path, False),
            verifier=str(verifier))
    else:
        vocab = _field(raw, "vocab_size", "int", path)
        if vocab is None:
            raise HeadFileError(f"{path}: vocab_size (the target's vocabulary) is missing")
        aux: tuple = ()
        if layout == "specforge":
            eagle = raw["eagle_config"]
            if not isinstance(eagle, dict):
                raise HeadFileError(f"{path}: eagle_config must be an object, got {eagle!r}")
            outputs = _layer_ids(eagle, "eagle_aux_hidden_state_layer_ids", path, "eagle_config.")
            if outputs and min(outputs) < -1:
                raise HeadFileError(f"{path}: eagle_config.eagle_aux_hidden_state_layer_ids must be layer ids >= -1 "
                                    f"(-1: the embeddings), got {list(outputs)}")
            aux = tuple(i + 1 for i in outputs)  # the output of layer i is hidden_states[i + 1]
        else:
            aux = _layer_ids(raw, "eagle_aux_hidden_state_layer_ids", path)  # moe_spec's extension
        num_layers = _field(raw, "num_hidden_layers", "int", path, 1)
        if num_layers != 1:
            raise HeadFileError(f"{path}: num_hidden_layers {num_layers}: the {layout} layout holds one layer "
                                "(`midlayer`); a deeper head comes in the speculators layout")
        fields = dict(
            layer=_layer_fields(raw, path), vocab_size=vocab, aux_layers=aux,
            target_hidden_size=_field(raw, "target_hidden_size", "int", path, 0),
            draft_vocab_size=_field(raw, "draft_vocab_size", "int", path, 0),
            norm_before_residual=_field(raw, "norm_before_residual", "bool", path, False),
            fc_norm=_field(raw, "fc_norm", "bool", path, False),
            logits_norm=_field(raw, "norm_output", "bool", path, True),  # SpecForge's meaning
            verifier=str(raw.get("_name_or_path") or ""))
    try:
        return EagleConfig(**fields)
    except (TypeError, ValueError) as error:
        raise HeadFileError(f"draft head config {path} is invalid: {error}") from None


# ---------------------------------------------------------------------------------------------
# tensor names


def _file_name(name: str, layout: str) -> str:
    """An `EagleHead` state-dict name -> its name in `layout`'s weights file."""
    if layout != "speculators" and name.startswith("layers.0."):
        return "midlayer." + name[len("layers.0."):]
    return name


def expected_tensors(config: EagleConfig, layout: str, with_embedding: bool, with_vocab_map: bool) -> dict:
    """file tensor name -> (shape, dtype or None) of a head with this config, computed on the meta device."""
    with torch.device("meta"):
        skeleton = EagleHead(config, with_embedding=with_embedding)
    expected = {_file_name(name, layout): (tuple(t.shape), None) for name, t in skeleton.state_dict().items()}
    if with_vocab_map:
        expected["d2t"] = ((config.draft_vocab,), torch.int64)
        expected["t2d"] = ((config.vocab_size,), torch.bool)
    return expected


# ---------------------------------------------------------------------------------------------
# loading


def load_head(directory: str | Path, dtype: torch.dtype | None = torch.float32) -> EagleHead:
    """The head in `directory`, in whichever of `LAYOUTS` its config.json is written; floating weights
    cast to `dtype` (None: the file's, which must then be one dtype throughout)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise HeadFileError(f"draft head folder {directory} does not exist")
    config_path = directory / CONFIG_FILE
    raw = read_config_file(config_path)
    layout = detect_layout(raw, config_path)
    config = config_from_raw(raw, layout, config_path)
    path, names = _weights_header(directory)
    with_embedding = "embed_tokens.weight" in names
    with_vocab_map = "d2t" in names or "t2d" in names or config.draft_vocab != config.vocab_size
    expected = expected_tensors(config, layout, with_embedding, with_vocab_map)
    state = _read_weights(path, expected, names)
    not_float = sorted(k for k, v in state.items() if k not in ("d2t", "t2d") and not v.is_floating_point())
    if not_float:
        raise TensorFileError(f"{path}: weights {not_float[:5]} are not floating point")
    draft_to_target = _draft_to_target(state, config, path) if with_vocab_map else None
    if dtype is None:
        found = {t.dtype for k, t in state.items() if k not in ("d2t", "t2d")}
        if len(found) != 1:
            raise TensorFileError(f"{path} mixes floating dtypes {sorted(map(str, found))}; name one to load it in")
        dtype = found.pop()
    head = EagleHead(config, draft_to_target, with_embedding=with_embedding).to(dtype)
    internal = {name: _file_name(name, layout) for name in head.state_dict()}
    head.load_state_dict({name: state[file_name].to(dtype) for name, file_name in internal.items()})
    head.layout = layout
    return head.eval()


def _weights_header(directory: Path) -> tuple[Path, dict[str, Path] | set[str]]:
    """The weights file of a head folder and the tensor names its header (or pickle) declares; for a
    sharded head, its index and each name's shard."""
    path = directory / WEIGHTS_FILE
    if path.is_file():
        return path, set(read_header(path))
    index = directory / SHARD_INDEX_FILE
    if index.is_file():
        return index, _shards(index)
    if (directory / LEGACY_WEIGHTS_FILE).is_file():
        raise HeadFileError(
            f"{directory / LEGACY_WEIGHTS_FILE} is a pickle, which moe_spec never reads (a file would be code); "
            f"convert it to {WEIGHTS_FILE} once, where you trust the file: python -c \"import torch; from "
            f"safetensors.torch import save_file; save_file(torch.load('{LEGACY_WEIGHTS_FILE}', weights_only=True), "
            f"'{WEIGHTS_FILE}')\"")
    raise HeadFileError(f"{directory} has no {WEIGHTS_FILE} (nor {SHARD_INDEX_FILE})")


def _shards(index: Path) -> dict[str, Path]:
    """tensor name -> shard file, from a safetensors index whose shards all lie in its folder."""
    raw = read_config_file(index)
    weight_map = raw.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise HeadFileError(f"{index}: weight_map must be a non-empty object of tensor name -> shard file")
    shards = {}
    for name, file in weight_map.items():
        if not isinstance(file, str) or Path(file).name != file:
            raise HeadFileError(f"{index}: the shard of {name!r} must be a file name in the same folder, got {file!r}")
        shard = index.parent / file
        if not shard.is_file():
            raise HeadFileError(f"{index} names shard {file}, which is not in {index.parent}")
        shards[name] = shard
    return shards


def _read_weights(path: Path, expected: dict, names) -> dict[str, torch.Tensor]:
    if path.name == WEIGHTS_FILE:
        return read_tensors(path, expected)
    if path.name == SHARD_INDEX_FILE:  # the index names exactly the expected tensors, each shard holds its share
        missing, extra = sorted(set(expected) - set(names)), sorted(set(names) - set(expected))
        if missing or extra:
            raise TensorFileError(f"{path} indexes other tensors than expected: missing {missing[:5]}, unexpected {extra[:5]}")
        state = {}
        for shard in sorted(set(names.values())):
            state.update(read_tensors(shard, {n: expected[n] for n, s in names.items() if s == shard}))
        return state
    raise HeadFileError(f"{path}: not a weights file moe_spec reads")


def _draft_to_target(state: dict, config: EagleConfig, path: Path) -> torch.Tensor:
    """[Vd] target ids from the file's `d2t` offsets, checked in range and against `t2d`."""
    draft = torch.arange(config.draft_vocab)
    ids = draft + state["d2t"] if "d2t" in state else draft
    if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < config.vocab_size):
        raise TensorFileError(f"{path}: d2t maps draft ids outside the target vocabulary 0..{config.vocab_size - 1}")
    if ids.unique().numel() != ids.numel():
        raise TensorFileError(f"{path}: d2t maps two draft ids onto one target id")
    if "t2d" in state:
        in_draft = torch.zeros(config.vocab_size, dtype=torch.bool)
        in_draft[ids] = True
        if not torch.equal(in_draft, state["t2d"].bool()):
            raise TensorFileError(f"{path}: t2d does not mark exactly the target ids that d2t maps onto")
    return ids


# ---------------------------------------------------------------------------------------------
# saving


def save_head(head: EagleHead, directory: str | Path, layout: str = "speculators", dtype: torch.dtype = torch.bfloat16,
              ttt_steps: int = 3) -> None:
    """Write `head` into `directory` in `layout` (config.json + model.safetensors, floating weights in
    `dtype`; d2t/t2d only where the draft vocabulary is reduced; the embedding only if the head has one)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    config = head.config
    raw = _config_raw(config, layout, dtype, ttt_steps)
    state = {_file_name(name, layout): (t.to(dtype) if t.is_floating_point() else t).detach().cpu().contiguous()
             for name, t in head.state_dict().items()}
    if config.draft_vocab != config.vocab_size or not torch.equal(head.draft_to_target.cpu(), torch.arange(config.draft_vocab)):
        ids = head.draft_to_target.cpu()
        state["d2t"] = (ids - torch.arange(config.draft_vocab)).contiguous()
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        state["t2d"] = t2d
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(state, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    (directory / CONFIG_FILE).write_text(json.dumps(raw, indent=2) + "\n")


def _dtype_label(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _layer_raw(config: EagleConfig) -> dict:
    """The Llama fields of the head's layers as transformers 5 writes them (`rope_parameters`, `head_dim`)."""
    return {**config.layer, "num_hidden_layers": config.num_layers, "vocab_size": config.vocab_size,
            "tie_word_embeddings": False}


def _config_raw(config: EagleConfig, layout: str, dtype: torch.dtype, ttt_steps: int) -> dict:
    layer = _layer_raw(config)
    if layout == "speculators":  # as speculators 0.9.0's own save_pretrained writes it
        if not config.logits_norm:
            raise MoeSpecError("the speculators layout has no head whose logits skip the final norm: save it in "
                               "the specforge layout")
        return {
            "architectures": ["Eagle3DraftModel"],
            "speculators_model_type": "eagle3",
            "speculators_version": SPECULATORS_VERSION,
            "transformer_layer_config": {"model_type": "qwen3" if config.qk_norm else "llama", **layer},
            "draft_vocab_size": config.draft_vocab,
            "norm_before_residual": config.norm_before_residual,
            "norm_before_fc": config.norm_before_fc,
            "fc_norm": config.fc_norm,
            "norm_output": config.norm_output,
            "embed_requires_grad": False,
            "target_hidden_size": config.target_hidden_size or None,
            "eagle_aux_hidden_state_layer_ids": list(config.aux_layers) or None,
            "speculators_config": {
                "algorithm": "eagle3",
                "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": ttt_steps,
                                      "accept_tolerance": 0.0, "verifier_accept_k": 1}],
                "verifier": {"name_or_path": config.verifier or None, "architectures": []},
            },
            "tie_word_embeddings": False,
            "dtype": _dtype_label(dtype),
        }
    unsupported = [name for name in ("qk_norm", "norm_before_fc", "norm_output") if getattr(config, name)]
    if layout != "specforge":
        unsupported += [name for name, on in (("fc_norm", config.fc_norm), ("logits without the final norm",
                                                                              not config.logits_norm)) if on]
    if config.num_layers != 1:
        unsupported.append(f"num_layers={config.num_layers}")
    if unsupported:
        raise MoeSpecError(f"the {layout} layout cannot hold a head with {', '.join(unsupported)}: save it in the "
                           "speculators layout")
    raw = {"architectures": [_ANGELSLIM_ARCHITECTURE if layout == "angelslim" else _EAGLE_ARCHITECTURE],
           "model_type": "llama", **layer, "draft_vocab_size": config.draft_vocab, "torch_dtype": _dtype_label(dtype)}
    if config.target_hidden_size:
        raw["target_hidden_size"] = config.target_hidden_size
    if config.norm_before_residual:
        raw["norm_before_residual"] = True
    if layout == "specforge":  # layer outputs: hidden state i is the output of layer i - 1 (-1: the embeddings)
        raw["eagle_config"] = {"use_aux_hidden_state": True}
        if config.aux_layers:
            raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [i - 1 for i in config.aux_layers]
        raw["norm_output"] = config.logits_norm  # SpecForge's meaning
        if config.fc_norm:
            raw["fc_norm"] = True
    elif config.aux_layers:
        raw["eagle_aux_hidden_state_layer_ids"] = list(config.aux_layers)
    if config.verifier:
        raw["_name_or_path"] = config.verifier
    return raw
