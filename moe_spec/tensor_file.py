"""Reading a safetensors file that may be truncated, corrupt or made for something else.

safetensors holds no code (unlike a pickle), but its header still declares what gets allocated.
`read_tensors` reads the header alone first (8 bytes of length, then JSON), checks that it is a
table of tensors whose byte ranges tile the file exactly and, when told what to expect, that the
names, shapes and dtypes are those; only then are the tensors read. Every failure is a
`TensorFileError` naming the file and what is wrong.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from moe_spec.errors import MoeSpecError

_MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit
_ITEM_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
               "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
_DTYPE_NAMES = {torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16", torch.float16: "F16",
                torch.bfloat16: "BF16", torch.int32: "I32", torch.float32: "F32", torch.int64: "I64",
                torch.float64: "F64"}


class TensorFileError(MoeSpecError):
    """A safetensors file that is unreadable, truncated, corrupt, or holds other tensors than expected."""


Expected = dict[str, tuple[tuple[int, ...], torch.dtype | None]]  # name -> (shape, dtype or None: any)


def read_header(path: str | Path) -> dict[str, dict]:
    """name -> {"dtype", "shape", "data_offsets"} from the file's header, checked against its size."""
    path = Path(path)
    try:
        with path.open("rb") as file:
            size = path.stat().st_size
            prefix = file.read(8)
            if len(prefix) < 8:
                raise TensorFileError(f"{path} is {size} bytes, too short for a safetensors file")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > min(_MAX_HEADER_BYTES, size - 8):
                raise TensorFileError(f"{path} declares a {header_len}-byte header in a {size}-byte file "
                                      "(truncated, or not a safetensors file)")
            raw = file.read(header_len)
    except OSError as error:
        raise TensorFileError(f"cannot read {path}: {error.strerror or error}") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise TensorFileError(f"{path}: the header is not JSON (corrupt, or not a safetensors file)") from None
    if not isinstance(header, dict):
        raise TensorFileError(f"{path}: the header is not a JSON object")
    header.pop("__metadata__", None)
    data_bytes = size - 8 - header_len
    ranges = []
    for name, entry in header.items():
        ranges.append(_checked_entry(path, name, entry))
    ranges.sort()
    end = 0
    for begin, stop, name in ranges:
        if begin != end:
            raise TensorFileError(f"{path}: tensor {name!r} starts at byte {begin}, expected {end} (corrupt header)")
        end = stop
    if end != data_bytes:
        state = "truncated" if end > data_bytes else "has trailing bytes"
        raise TensorFileError(f"{path}: the header describes {end} bytes of tensor data, the file holds {data_bytes} "
                              f"({state})")
    return header


def _checked_entry(path: Path, name: str, entry) -> tuple[int, int, str]:
    if not isinstance(entry, dict):
        raise TensorFileError(f"{path}: header entry {name!r} is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in _ITEM_BYTES:
        raise TensorFileError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise TensorFileError(f"{path}: tensor {name!r} has a malformed shape {shape!r}")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets) or not 0 <= offsets[0] <= offsets[1]):
        raise TensorFileError(f"{path}: tensor {name!r} has malformed data_offsets {offsets!r}")
    if offsets[1] - offsets[0] != math.prod(shape) * _ITEM_BYTES[dtype]:
        raise TensorFileError(f"{path}: tensor {name!r} of shape {shape} and dtype {dtype} does not fill its "
                              f"{offsets[1] - offsets[0]} bytes")
    return offsets[0], offsets[1], name


def check_expected(path: str | Path, header: dict[str, dict], expected: Expected) -> None:
    """Raise `TensorFileError` listing missing, unexpected and wrongly shaped or typed tensors."""
    missing = sorted(set(expected) - set(header))
    extra = sorted(set(header) - set(expected))
    wrong = []
    for name in sorted(set(expected) & set(header)):
        shape, dtype = expected[name]
        entry = header[name]
        if tuple(entry["shape"]) != tuple(shape):
            wrong.append(f"{name}: shape {entry['shape']}, expected {list(shape)}")
        elif dtype is not None and entry["dtype"] != _DTYPE_NAMES.get(dtype):
            wrong.append(f"{name}: dtype {entry['dtype']}, expected {_DTYPE_NAMES.get(dtype)}")
    problems = ([f"missing {_listed(missing)}"] if missing else []) + ([f"unexpected {_listed(extra)}"] if extra else [])
    problems += wrong[:5] + ([f"... {len(wrong) - 5} more"] if len(wrong) > 5 else [])
    if problems:
        raise TensorFileError(f"{path} holds other tensors than expected: {'; '.join(problems)}")


def _listed(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def read_tensors(path: str | Path, expected: Expected | None = None) -> dict[str, torch.Tensor]:
    """The tensors of `path` on the CPU, after its header passed `read_header` (and `check_expected`)."""
    header = read_header(path)
    if expected is not None:
        check_expected(path, header, expected)
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, RuntimeError, ValueError) as error:
        raise TensorFileError(f"cannot read the tensors of {path}: {error}") from None
