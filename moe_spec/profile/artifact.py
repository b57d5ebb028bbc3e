"""The profile: what the profiler measured for one target on one machine, versioned, reusable.

A profile is a JSON file plus a sidecar `.npz` with the large arrays (the token-id expert table,
the expert load and co-activation, the head routing predictor's weights). The JSON holds the schema version, the target's fingerprint
(architecture, shapes, dtype, a hash of the weights), the hardware, and one typed section per
thing a controller reads: the cost model, the acceptance calibration, the expert predictor (with
its pricing form), the unique-experts curve and, optionally, the head routing predictor (which
predicts a draft node's experts from the head's output at its parent, and whether the profile
keeps it over the token table: `moe_spec.profile.head_routing`). `details` holds the measurements' summaries
(reports, the latency grid, settings), which no policy reads. The JSON names the sidecar and its sha256.

`Profile.load` raises `ProfileError` with a message naming the problem for a file that is
missing, truncated, corrupt, of a newer schema, or made for another target; never a
`KeyError` deep inside the controller.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import math
import os
import platform
import zipfile
import zlib
from dataclasses import dataclass, field
from typing import NamedTuple
from enum import Enum
from pathlib import Path

import numpy as np
import torch
import transformers

from moe_spec.profile.cost_model import CostModel
from moe_spec.errors import MoeSpecError
from moe_spec.core.sampling import SamplingConfig
from moe_spec.profile.calibration import AcceptanceCalibration
from moe_spec.profile.arm_rates import ArmRates
from moe_spec.profile.sampling_acceptance import (SchemeChoice, SettingAcceptance, calibration_for, chain_conditional_for,
                                                  preferred_scheme)
from moe_spec.profile.expert_table import TokenExpertTable
from moe_spec.profile.head_routing import ARRAY_SHAPES as HEAD_ROUTING_ARRAYS, HeadRouting, HeadRoutingPredictor
from moe_spec.profile.unique_curve import UniqueExpertsCurve
from moe_spec.core.routing import find_routers
from moe_spec.core.target import TargetModel

# 2: the cost model's per_row_ms (version-1 files are read with per_row_ms = 0);
# 3: the expert pricing form and the unique-experts curve are typed sections (read from details before)
SCHEMA_VERSION = 3
_TABLE_KIND = "token_id_table"
_HEAD_ROUTING_KIND = "head_routing_linear"
_HEAD_ROUTING_PREFIX = "head_routing_"
_HASH_ELEMENTS = 4096  # elements sampled per tensor for the weights hash


class ProfileError(MoeSpecError):
    """A profile file that cannot be used for this target: missing, corrupt, too new, or another model's."""


def hash_sample(tensor: torch.Tensor) -> torch.Tensor:
    """[<= 4096] evenly spaced values of `tensor` (all of them when it has fewer).

    The positions are a float32 linspace, as profiles have always been hashed; past 2**24 elements
    float32 rounds the last position up to one past the end for some sizes (OLMoE-1B-7B's expert
    tensors), so positions are clamped to the last element, which leaves every smaller tensor's
    sample, and so every existing fingerprint, unchanged."""
    flat = tensor.detach().reshape(-1)
    if flat.numel() <= _HASH_ELEMENTS:
        return flat
    positions = torch.linspace(0, flat.numel() - 1, _HASH_ELEMENTS).long()  # on the CPU, as always
    return flat[positions.clamp_(max=flat.numel() - 1)]


def fingerprint(model) -> dict:
    """Architecture, shapes, dtype and a weights hash identifying a target (`PreTrainedModel` or `TargetModel`).

    The hash covers every state-dict tensor's name and shape and a deterministic, evenly spaced
    sample of up to 4096 of its values cast to float32, so it identifies the weights whatever
    dtype they were loaded in (the dtype is recorded separately) and takes well under a second.
    """
    if isinstance(model, TargetModel):
        if model.offload is not None and model.offload.model_fingerprint is not None:
            return dict(model.offload.model_fingerprint)  # taken before the experts' weights left the model
        model = model.model
    if any(p.is_meta for p in model.parameters()):
        raise ProfileError("this model's weights are not all loaded (offloaded experts?); fingerprint the "
                           "TargetModel that carries its offload instead")
    config = model.config.get_text_config(decoder=True)
    routers = find_routers(model)
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(f"{name}:{tuple(tensor.shape)};".encode())
        digest.update(hash_sample(tensor).to(device="cpu", dtype=torch.float32).contiguous().numpy().tobytes())
    return {
        "model_type": str(config.model_type),
        "num_layers": int(config.num_hidden_layers),
        "moe_layers": [r.layer for r in routers],
        "hidden_size": int(config.hidden_size),
        "num_experts": routers[0].num_experts if routers else 0,
        "top_k": routers[0].top_k if routers else 0,
        "vocab_size": int(model.get_input_embeddings().num_embeddings),
        "dtype": str(model.dtype).removeprefix("torch."),
        "num_parameters": int(sum(p.numel() for p in model.parameters())),
        "weights_sha256": digest.hexdigest(),
    }


def hardware_description(device: torch.device | str = "cpu") -> dict:
    """The machine the timings were taken on."""
    device = torch.device(device)
    description = {
        "device": str(device),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "l3_cache": _read("/sys/devices/system/cpu/cpu0/cache/index3/size"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    if device.type == "cuda":
        description["gpu"] = torch.cuda.get_device_name(device)
    return description


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _cpu_model() -> str:
    for line in (_read("/proc/cpuinfo") or "").splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


class ExpertPricing(str, Enum):
    """The form in which the expert table's predictions are fed to the cost model: each node's K most
    likely experts as 0/1 sets, or the probabilities themselves (the profiler keeps whichever
    predicted held-out trees' unique-expert counts better; probabilities over many nodes add up to
    an overestimate of the union)."""

    TOPK = "topk"
    PROBABILITIES = "probabilities"


class DraftCost(NamedTuple):
    """A step's draft time as the profiler fitted it: base + per_depth * depth + per_node * nodes (ms)."""

    base_ms: float
    per_depth_ms: float
    per_node_ms: float


@dataclass(frozen=True)
class Profile:
    fingerprint: dict
    hardware: dict
    cost_model: CostModel
    calibration: AcceptanceCalibration | None  # None when the drafter proposed nothing to calibrate on
    expert_table: TokenExpertTable | None  # None for a dense target
    expert_pricing: ExpertPricing | None = None  # how `expert_table` is priced; None exactly when there is no table
    unique_experts_curve: UniqueExpertsCurve | None = None  # None for a dense target
    details: dict = field(default_factory=dict)  # JSON summaries: reports, latency grid, settings (policies read `draft_cost`)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)  # sidecar extras, e.g. routing_load [L, E]
    schema_version: int = SCHEMA_VERSION
    # acceptance per sampling setting and candidate scheme (empty: only greedy was profiled)
    sampling_acceptance: tuple[SettingAcceptance, ...] = ()
    # a draft node's experts predicted from the head's output at its parent (None: not fitted)
    head_routing: HeadRouting | None = None
    # each arm of moe-aware's bound measured per sampling setting (empty: not measured)
    arm_rates: tuple[ArmRates, ...] = ()

    def __post_init__(self):
        if (self.expert_table is None) != (self.expert_pricing is None):
            raise ValueError("a profile prices experts (expert_pricing) exactly when it has an expert table")
        if self.head_routing is not None and self.expert_table is None:
            raise ValueError("a head routing predictor needs the expert table (it prices roots and is blended with it)")
        if self.expert_pricing is not None:
            object.__setattr__(self, "expert_pricing", ExpertPricing(self.expert_pricing))

    def calibrated_path_probability(self, tree) -> torch.Tensor:
        """[N] P(node on the accepted path), from the calibration (see `AcceptanceCalibration`)."""
        if self.calibration is None:
            raise ProfileError("this profile has no acceptance calibration (the drafter proposed no nodes)")
        return self.calibration.path_probability(tree)

    def preferred_scheme(self, sampling: SamplingConfig) -> SchemeChoice:
        """Whether sampled or top-token candidates accepted more at the profiled setting nearest to
        `sampling` (see `moe_spec.profile.sampling_acceptance`)."""
        if not self.sampling_acceptance:
            raise ProfileError("this profile measured no sampling setting")
        return preferred_scheme(self.sampling_acceptance, sampling)

    def calibration_for(self, sampling: SamplingConfig, sampled: bool) -> AcceptanceCalibration | None:
        """The acceptance calibration for a request: the greedy one, or the nearest profiled sampling
        setting's for this scheme."""
        return calibration_for(self.sampling_acceptance, sampling, sampled, self.calibration)

    @property
    def draft_cost(self) -> "DraftCost":
        """The drafter's measured time per step, as the profiler fitted it ((0, 0, 0) where it did not)."""
        section = self.details.get("draft_cost") or {}
        return DraftCost(*(float(section.get(key, 0.0)) for key in ("base_ms", "per_depth_ms", "per_node_ms")))

    @property
    def num_experts(self) -> int:
        """Routed experts per MoE layer of the profiled target (0: dense)."""
        return int(self.fingerprint.get("num_experts") or 0)

    @property
    def top_k(self) -> int:
        """Experts each token routes to (0: dense)."""
        return int(self.fingerprint.get("top_k") or 0)

    def chain_conditional_for(self, sampling: SamplingConfig) -> tuple[float, ...]:
        """Sampled chains' mean P(accepted | parent reached) per depth at the profiled setting nearest
        to `sampling` (empty where not measured)."""
        return chain_conditional_for(self.sampling_acceptance, sampling)

    def priced_experts(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: [N] long -> [L, N, E] the predicted routing of those tokens in the `expert_pricing` form."""
        if self.expert_table is None:
            raise ProfileError("this profile has no expert predictor (dense target)")
        if self.expert_pricing is ExpertPricing.TOPK:
            return self.expert_table.predict_onehot_tokens(tokens)
        return self.expert_table.predict_tokens(tokens)

    def predict_verify_ms(self, tree) -> float:
        """Verify time of `tree` in ms, with its experts predicted from the token ids (`priced_experts`)."""
        if self.expert_table is None:
            return self.cost_model.predict_ms(len(tree), [])
        return self.cost_model.predict(tree, self.priced_experts(tree.tokens))

    def save(self, path: str | Path) -> Path:
        """Write `path` (JSON) and its sidecar `path` with suffix `.npz` (folders made as needed);
        returns the sidecar path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        sidecar = path.with_suffix(".npz")
        arrays = self.expert_table.arrays() if self.expert_table is not None else {}
        if self.head_routing is not None:
            arrays.update(self.head_routing.predictor.arrays())
        clash = set(arrays) & set(self.arrays)
        if clash:
            raise ValueError(f"array names {sorted(clash)} are reserved for the expert predictors")
        arrays.update(self.arrays)
        buffer = io.BytesIO()
        np.savez_compressed(buffer, **arrays)
        sidecar.write_bytes(buffer.getvalue())
        document = {
            "schema_version": self.schema_version,
            "fingerprint": self.fingerprint,
            "hardware": self.hardware,
            "cost_model": self.cost_model.to_dict(),
            "calibration": self.calibration.to_dict() if self.calibration is not None else None,
            "expert_predictor": (
                {"kind": _TABLE_KIND, "pricing": self.expert_pricing.value, "pseudo_count": self.expert_table.pseudo_count,
                 "arrays": sorted(self.expert_table.arrays())}
                if self.expert_table is not None
                else None
            ),
            "unique_experts_curve": self.unique_experts_curve.to_dict() if self.unique_experts_curve is not None else None,
            "sampling_acceptance": [entry.to_dict() for entry in self.sampling_acceptance],
            "arm_rates": [entry.to_dict() for entry in self.arm_rates],
            **({"head_routing": {"kind": _HEAD_ROUTING_KIND, "keeps": self.head_routing.keeps.value,
                                 "arrays": sorted(self.head_routing.predictor.arrays()), "report": self.head_routing.report}}
               if self.head_routing is not None else {}),
            "details": self.details,
            "arrays": {"file": sidecar.name, "sha256": hashlib.sha256(buffer.getvalue()).hexdigest()},
        }
        path.write_text(json.dumps(_finite(document), indent=1) + "\n")
        return sidecar

    @staticmethod
    def load(path: str | Path, target=None) -> "Profile":
        """Read and validate a profile; with `target` (a model or `TargetModel`), also check that the
        profile was made for it. Raises `ProfileError` naming the problem."""
        path = Path(path)
        try:
            size = path.stat().st_size
            if size > _MAX_JSON_BYTES:
                raise ProfileError(f"profile {path} is {size} bytes, more than a profile's JSON ever holds "
                                   f"({_MAX_JSON_BYTES}); is it a profile?")
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as error:
            raise ProfileError(f"cannot read profile {path}: {error}") from error
        try:
            document = json.loads(text)
        except json.JSONDecodeError as error:
            raise ProfileError(f"profile {path} is not valid JSON (truncated or corrupt?): {error}") from error
        if not isinstance(document, dict):
            raise ProfileError(f"profile {path} is not a JSON object")
        version = document.get("schema_version")
        if not isinstance(version, int):
            raise ProfileError(f"profile {path} has no integer schema_version")
        if version > SCHEMA_VERSION:
            raise ProfileError(
                f"profile {path} has schema version {version}, newer than this moe_spec reads ({SCHEMA_VERSION}); "
                "upgrade moe_spec or profile the target again"
            )
        fp = document.get("fingerprint")
        if not isinstance(fp, dict):
            raise ProfileError(f"profile {path} has no 'fingerprint' section")
        if target is not None:  # before the sidecar is read or the expert table built from its shapes
            _check_fingerprint(fp, fingerprint(target), path)
        _check_shapes(fp, path)
        try:
            profile = _from_document(_migrated(document), path)
        except ProfileError:
            raise
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as error:
            raise ProfileError(f"profile {path} is malformed: {type(error).__name__}: {error}") from error
        return profile

    def check_target(self, target, path: str | Path = "profile") -> None:
        """Raise `ProfileError` unless this profile was made for `target`."""
        _check_fingerprint(self.fingerprint, fingerprint(target), path)


def _check_fingerprint(recorded: dict, current: dict, path: str | Path) -> None:
    differences = [f"{key}: profile {recorded.get(key)!r}, target {value!r}"
                   for key, value in current.items() if recorded.get(key) != value]
    if differences:
        raise ProfileError(
            f"{path} was made for another target ({'; '.join(differences)}); run `moe-spec profile` for this one"
        )


_MAX_JSON_BYTES = 256 * 2**20
_MAX_TABLE_BYTES = 32 * 2**30  # the expert table's two [V, L, E] float32 lookups (a 129k-vocabulary,
#                                58-layer, 256-expert DeepSeek-V3 takes 15 GiB)
_MAX_EXTRA_ELEMENTS = 2**24  # a sidecar extra beyond [L, E, E] (the co-activation counts)
_MAX_RANK = 1024  # the head routing predictor's projections (it is fitted at ranks of tens)


def _check_shapes(fp: dict, path: Path) -> None:
    """The fingerprint's shape fields are what their names say, within bounds the expert table can be built in."""
    counts = {key: fp.get(key) for key in ("num_layers", "hidden_size", "num_experts", "top_k", "vocab_size")}
    bad = [f"{key}={value!r}" for key, value in counts.items() if not _is_count(value)]
    layers = fp.get("moe_layers")
    if not isinstance(layers, list) or not all(_is_count(i) for i in layers):
        bad.append(f"moe_layers={layers!r}")
    if bad:
        raise ProfileError(f"profile {path}: fingerprint fields {', '.join(bad)} are not non-negative integers")
    if counts["top_k"] > counts["num_experts"] or len(layers) > counts["num_layers"]:
        raise ProfileError(f"profile {path}: fingerprint is inconsistent (top_k {counts['top_k']} of "
                           f"{counts['num_experts']} experts, {len(layers)} MoE layers of {counts['num_layers']})")
    table_bytes = 8 * counts["vocab_size"] * len(layers) * counts["num_experts"]
    if table_bytes > _MAX_TABLE_BYTES:
        raise ProfileError(f"profile {path}: an expert table of vocabulary {counts['vocab_size']} x {len(layers)} "
                           f"layers x {counts['num_experts']} experts would take {table_bytes / 2**30:.0f} GiB")


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _migrated(document: dict) -> dict:
    """A schema-1 or -2 document in schema 3's layout: the pricing form and the unique-experts curve
    move from `details` to their own sections (version 1's missing per_row_ms is `CostModel`'s 0)."""
    if document["schema_version"] >= 3:
        return document
    document = copy.deepcopy(document)
    details = document.get("details")
    if not isinstance(details, dict):
        return document
    report = details.get("expert_predictor") or {}
    if document.get("expert_predictor"):
        # version 2 priced probabilities unless the report said "topk"
        pricing = report.get("pricing")
        document["expert_predictor"].update(kind=report.get("kind", _TABLE_KIND),
                                            pricing=pricing if pricing == "topk" else "probabilities")
    for key in ("kind", "pricing"):
        report.pop(key, None)
    document["unique_experts_curve"] = (details.get("routing") or {}).pop("unique_experts_curve", None)
    return document


def _from_document(document: dict, path: Path) -> Profile:
    for key in ("fingerprint", "hardware", "cost_model", "arrays"):
        if not isinstance(document.get(key), dict):
            raise ProfileError(f"profile {path} has no {key!r} section")
    fp = document["fingerprint"]
    num_layers = len(fp["moe_layers"])
    arrays = _read_sidecar(document["arrays"], path, fp)
    cost_model = CostModel.from_dict(document["cost_model"])
    if cost_model.num_layers != num_layers:
        raise ProfileError(f"profile {path}: cost model has {cost_model.num_layers} layers, target {num_layers}")
    calibration = AcceptanceCalibration.from_dict(document["calibration"]) if document.get("calibration") else None
    table, pricing = _expert_predictor(document.get("expert_predictor"), arrays, fp, path)
    curve = UniqueExpertsCurve.from_dict(document["unique_experts_curve"]) if document.get("unique_experts_curve") else None
    if curve is not None and curve.num_layers != num_layers:
        raise ProfileError(f"profile {path}: unique-experts curve has {curve.num_layers} layers, target {num_layers}")
    head_routing = _head_routing(document.get("head_routing"), arrays, fp, path, table)
    extras = {k: v for k, v in arrays.items() if not k.startswith(("predictor_", _HEAD_ROUTING_PREFIX))}
    details = document.get("details") or {}
    if not isinstance(details, dict):
        raise ProfileError(f"profile {path}: 'details' is not an object")
    settings = document.get("sampling_acceptance") or []
    if not isinstance(settings, list):
        raise ProfileError(f"profile {path}: 'sampling_acceptance' is not a list")
    arm_rates = document.get("arm_rates") or []
    if not isinstance(arm_rates, list):
        raise ProfileError(f"profile {path}: 'arm_rates' is not a list")
    return Profile(fp, document["hardware"], cost_model, calibration, table, pricing, curve, details, extras,
                   int(document["schema_version"]), tuple(SettingAcceptance.from_dict(e) for e in settings), head_routing,
                   tuple(ArmRates.from_dict(e) for e in arm_rates))


def _read_sidecar(meta: dict, path: Path, fp: dict) -> dict[str, np.ndarray]:
    """The sidecar's arrays, each member's .npy header checked (no object dtype, a shape the
    fingerprint allows) before it is decompressed; never unpickled."""
    name, digest = meta.get("file"), meta.get("sha256")
    if not isinstance(name, str) or Path(name).name != name or not isinstance(digest, str):
        raise ProfileError(f"profile {path}: 'arrays' must name a file beside it and its sha256, got {meta!r}")
    sidecar = path.parent / name
    try:
        blob = sidecar.read_bytes()
    except OSError as error:
        raise ProfileError(f"profile {path} refers to arrays in {sidecar}, which cannot be read: {error}") from error
    if hashlib.sha256(blob).hexdigest() != digest:
        raise ProfileError(f"{sidecar} does not match the checksum recorded in {path} (corrupt, or from another profile)")
    expected = _expected_arrays(fp)
    arrays = {}
    try:
        with zipfile.ZipFile(io.BytesIO(blob)) as archive:
            for info in archive.infolist():
                if not info.filename.endswith(".npy"):
                    raise ProfileError(f"{sidecar}: member {info.filename!r} is not a .npy array")
                key = info.filename.removesuffix(".npy")
                with archive.open(info) as member:
                    version = np.lib.format.read_magic(member)
                    shape, fortran, dtype = _ARRAY_HEADER_READERS[version](member)
                    _check_array(sidecar, key, shape, dtype, expected)
                    arrays[key] = _read_data(member, shape, fortran, dtype)
    except ProfileError:
        raise
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError, KeyError, TypeError) as error:
        raise ProfileError(f"{sidecar} is not a readable .npz of arrays ({type(error).__name__}: {error})") from None
    return arrays


_ARRAY_HEADER_READERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}


def _expected_arrays(fp: dict) -> dict[str, tuple]:
    """name -> shape of the arrays a sidecar may hold for this fingerprint ("S": any count up to the vocabulary)."""
    layers, experts = len(fp["moe_layers"]), int(fp["num_experts"])
    letters = {"D": int(fp["hidden_size"]), "V": int(fp["vocab_size"]), "L": layers, "L*E": layers * experts,
               "R": "R", "Rh": "R"}
    return {
        "predictor_token_ids": ("S",), "predictor_token_totals": ("S",), "predictor_token_counts": ("S", layers, experts),
        "predictor_prior": (layers, experts), "routing_load": (layers, experts),
        "routing_coactivation": (layers, experts, experts),
        **{name: tuple(letters[letter] for letter in shape) for name, shape in HEAD_ROUTING_ARRAYS.items()},
    }


def _check_array(sidecar: Path, key: str, shape: tuple, dtype: np.dtype, expected: dict) -> None:
    if dtype.hasobject or dtype.kind not in "biuf":
        raise ProfileError(f"{sidecar}: array {key!r} has dtype {dtype}, not numbers")
    want = expected.get(key)
    if want is None:
        if math.prod(shape) > _MAX_EXTRA_ELEMENTS:
            raise ProfileError(f"{sidecar}: array {key!r} of shape {shape} is larger than any a profile stores")
        return
    if len(shape) != len(want) or any(w not in ("S", "R") and s != w for s, w in zip(shape, want)):
        raise ProfileError(f"{sidecar}: array {key!r} has shape {shape}, the fingerprint implies {want}")
    if any(w == "R" and not 1 <= s <= _MAX_RANK for s, w in zip(shape, want)):
        raise ProfileError(f"{sidecar}: array {key!r} has shape {shape}: a rank ('R') must be 1..{_MAX_RANK}")


def _read_data(member, shape: tuple, fortran: bool, dtype: np.dtype) -> np.ndarray:
    """The array body after its header: exactly the bytes the (checked) header declares, never more."""
    flat = np.empty(math.prod(shape), dtype=dtype)
    view = memoryview(flat).cast("B")
    filled = 0
    while filled < len(view):
        n = member.readinto(view[filled:])
        if not n:
            raise EOFError(f"array data ends after {filled} of {len(view)} bytes")
        filled += n
    return flat.reshape(shape, order="F" if fortran else "C")


def _expert_predictor(section: dict | None, arrays: dict, fp: dict, path: Path):
    """(table, pricing) from the `expert_predictor` section, or (None, None) when there is none."""
    if not section:
        return None, None
    if section.get("kind") != _TABLE_KIND:
        raise ProfileError(f"profile {path}: unknown expert predictor kind {section.get('kind')!r}")
    _check_table_arrays(arrays, int(fp["vocab_size"]), path)
    table = TokenExpertTable.from_arrays(arrays, int(fp["vocab_size"]), int(fp["top_k"]), float(section["pseudo_count"]))
    if table.prior.shape != (len(fp["moe_layers"]), int(fp["num_experts"])):
        raise ProfileError(f"profile {path}: expert table has shape {table.prior.shape}, fingerprint disagrees")
    return table, ExpertPricing(section["pricing"])


def _check_table_arrays(arrays: dict, vocab_size: int, path: Path) -> None:
    """The predictor arrays (their shapes already fit the fingerprint, `_check_array`) agree on the
    number of token ids, and those ids are distinct ids of the vocabulary."""
    names = ("predictor_token_ids", "predictor_token_totals", "predictor_token_counts", "predictor_prior")
    missing = [n for n in names if n not in arrays]
    if missing:
        raise ProfileError(f"profile {path}: the sidecar lacks the expert table's {', '.join(missing)}")
    ids = arrays["predictor_token_ids"]
    seen = {len(arrays[n]) for n in names[:3]}
    if len(seen) != 1 or len(ids) > vocab_size:
        raise ProfileError(f"profile {path}: the expert table's arrays disagree on the number of token ids "
                           f"({sorted(seen)}, vocabulary {vocab_size})")
    if ids.dtype.kind not in "iu" or (len(ids) and (ids.min() < 0 or ids.max() >= vocab_size)) or len(np.unique(ids)) != len(ids):
        raise ProfileError(f"profile {path}: predictor_token_ids must be distinct token ids in 0..{vocab_size - 1}")


def _head_routing(section, arrays: dict, fp: dict, path: Path, table: TokenExpertTable | None) -> HeadRouting | None:
    """The `head_routing` section and its arrays (shapes already checked against the fingerprint,
    `_check_array`), or None when there is none."""
    if section is None:
        return None
    if not isinstance(section, dict) or section.get("kind") != _HEAD_ROUTING_KIND:
        kind = section.get("kind") if isinstance(section, dict) else type(section).__name__
        raise ProfileError(f"profile {path}: unknown head routing predictor kind {kind!r} (expected {_HEAD_ROUTING_KIND!r})")
    if table is None:
        raise ProfileError(f"profile {path}: a head routing predictor needs the expert table, which this profile lacks")
    missing = [name for name in HEAD_ROUTING_ARRAYS if name not in arrays]
    if missing or sorted(section.get("arrays") or []) != sorted(HEAD_ROUTING_ARRAYS):
        raise ProfileError(f"profile {path}: the head routing section names arrays {section.get('arrays')!r}; "
                           f"the sidecar lacks {', '.join(missing) or 'none'} of {sorted(HEAD_ROUTING_ARRAYS)}")
    keeps = section.get("keeps")
    if keeps not in ("head", "token_table"):
        raise ProfileError(f"profile {path}: head_routing.keeps must be 'head' or 'token_table', got {keeps!r}")
    if not isinstance(section.get("report"), dict):
        raise ProfileError(f"profile {path}: head_routing.report is not an object")
    try:
        predictor = HeadRoutingPredictor.from_arrays(arrays, int(fp["num_experts"]), int(fp["top_k"]))
    except ValueError as error:
        raise ProfileError(f"profile {path}: head routing predictor: {error}") from None
    return HeadRouting(predictor, keeps, section["report"])


def _finite(value):
    """NaN / inf -> None, so the file is strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    if isinstance(value, np.generic):
        return _finite(value.item())
    return value
