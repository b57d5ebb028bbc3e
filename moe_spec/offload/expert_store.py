"""The expert store: a model's routed experts in one file, one aligned block per (layer, expert).

    store = write_store(model, folder)          # once, from the loaded weights
    store = ExpertStore.open(folder, model)     # checks it is this model's, intact and complete
    store.read(position, expert, buffer)        # one block, bypassing the page cache

Layout: a 16-byte magic, an 8-byte little-endian header length, a JSON header, then the blocks
from the first 4096-byte boundary on, layer by layer, expert by expert. A block holds every
routed-expert parameter of one expert (e.g. `gate_up_proj[e]`, `down_proj[e]`, their biases) back
to back in the model's dtype, padded to a multiple of 4096 bytes, so that each block can be read
with O_DIRECT (aligned offset, length and buffer). The header records the architecture, the
parameters' names, shapes and dtype, and a CRC-32 of every block.

A store is only ever used with the model it was written from: `open` compares the architecture,
the parameter shapes and dtype, and the checksum of each layer's first expert computed from the
model's own weights (so a store of another checkpoint with the same shapes is refused), and it
checks the file's length, so a truncated or foreign file is a `StoreError` naming the problem.

Reads bypass the page cache with O_DIRECT where the file system allows it; elsewhere (tmpfs, some
overlay file systems) the store falls back to buffered reads with a warning that its timings
include the page cache. `os.preadv` releases the GIL, so a thread pool reads blocks in parallel.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from moe_spec.errors import MoeSpecError

MAGIC = b"MOESPEC-EXPERTS\0"
VERSION = 1
ALIGN = 4096  # bytes: block offsets, lengths and read buffers are multiples of this (O_DIRECT)
FILE_NAME = "experts.store"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_MAX_HEADER_BYTES = 64 * 2**20


class StoreError(MoeSpecError):
    """An expert store that is missing, truncated, corrupt, or written from another model."""


def align_up(size: int, alignment: int = ALIGN) -> int:
    return -(-size // alignment) * alignment


@dataclass(frozen=True)
class ParamSpec:
    """One routed-expert parameter of one expert: `name[e]` has `shape`."""

    name: str  # attribute of the experts module, e.g. "gate_up_proj"
    shape: tuple[int, ...]  # of one expert's slice

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())


@dataclass(frozen=True)
class ExpertsModule:
    """An MoE layer's experts module, as transformers 5.23 builds it (`@use_experts_implementation`)."""

    layer: int  # decoder layer index
    module: nn.Module


def find_experts(model: nn.Module) -> list[ExpertsModule]:
    """The routed-experts modules of a model, by decoder layer (empty for a dense model).

    Every supported architecture's experts module goes through transformers' `ExpertsInterface`,
    which gives it `is_concatenated` and `num_experts`; shared experts are plain MLPs and stay put.
    """
    from moe_spec.core.routing import _LAYER_INDEX

    found = []
    for name, module in model.named_modules():
        if hasattr(module, "is_concatenated") and hasattr(module, "num_experts"):
            match = _LAYER_INDEX.search(name)
            if match is None:
                raise StoreError(f"experts module {name!r} is not inside a numbered decoder layer")
            found.append(ExpertsModule(int(match.group(1)), module))
    return sorted(found, key=lambda e: e.layer)


def expert_params(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The module's routed-expert parameters ([E, ...] each), in a fixed order."""
    num_experts = int(module.num_experts)
    params = [(n, p) for n, p in module.named_parameters(recurse=False) if p.dim() >= 1 and p.shape[0] == num_experts]
    return sorted(params, key=lambda item: item[0])


@dataclass(frozen=True)
class StoreLayout:
    model_type: str
    layers: tuple[int, ...]  # decoder layer index of each MoE layer, in file order
    num_experts: int
    params: tuple[ParamSpec, ...]  # the same for every layer
    dtype: str
    data_offset: int  # bytes: where the first block starts

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def payload_bytes(self) -> int:
        """Bytes of one expert's parameters, without padding."""
        return sum(p.numel for p in self.params) * torch.finfo(self.torch_dtype).bits // 8

    @property
    def block_bytes(self) -> int:
        return align_up(self.payload_bytes)

    @property
    def file_bytes(self) -> int:
        return self.data_offset + len(self.layers) * self.num_experts * self.block_bytes

    def offset(self, position: int, expert: int) -> int:
        """Byte offset of expert `expert` of the `position`-th MoE layer."""
        return self.data_offset + (position * self.num_experts + expert) * self.block_bytes

    def to_dict(self) -> dict:
        return {"model_type": self.model_type, "layers": list(self.layers), "num_experts": self.num_experts,
                "params": [{"name": p.name, "shape": list(p.shape)} for p in self.params], "dtype": self.dtype,
                "data_offset": self.data_offset}

    @staticmethod
    def from_dict(data: dict) -> "StoreLayout":
        return StoreLayout(str(data["model_type"]), tuple(int(v) for v in data["layers"]), int(data["num_experts"]),
                           tuple(ParamSpec(str(p["name"]), tuple(int(s) for s in p["shape"])) for p in data["params"]),
                           str(data["dtype"]), int(data["data_offset"]))


def layout_of(model: nn.Module, data_offset: int = 0) -> StoreLayout:
    """The store layout `model`'s experts need; `StoreError` when it has none or they differ by layer."""
    experts = find_experts(model)
    if not experts:
        raise StoreError(f"{type(model).__name__} has no routed experts to offload (a dense model)")
    first = experts[0].module
    params = tuple(ParamSpec(n, tuple(p.shape[1:])) for n, p in expert_params(first))
    dtypes = {p.dtype for e in experts for _, p in expert_params(e.module)}
    for e in experts:
        if tuple(ParamSpec(n, tuple(p.shape[1:])) for n, p in expert_params(e.module)) != params or \
                int(e.module.num_experts) != int(first.num_experts):
            raise StoreError(f"layer {e.layer}'s experts differ in shape from layer {experts[0].layer}'s; "
                             "a store needs the same experts in every MoE layer")
    dtype = next(iter(dtypes))
    names = {v: k for k, v in _DTYPES.items()}
    if len(dtypes) != 1 or dtype not in names:
        raise StoreError(f"expert weights must share one dtype among {sorted(_DTYPES)}, got {sorted(map(str, dtypes))}")
    return StoreLayout(str(model.config.model_type), tuple(e.layer for e in experts), int(first.num_experts),
                       params, names[dtype], data_offset)


def expert_block(module: nn.Module, expert: int, block_bytes: int) -> bytes:
    """Expert `expert`'s parameters, back to back, zero-padded to `block_bytes`."""
    parts = [p.detach()[expert].contiguous().cpu().reshape(-1).view(torch.uint8) for _, p in expert_params(module)]
    payload = torch.cat(parts).numpy().tobytes()
    return payload + bytes(block_bytes - len(payload))


def write_store(model: nn.Module, folder: str | Path) -> "ExpertStore":
    """Write `model`'s routed experts to `folder/experts.store` (atomically: a temporary file renamed
    once complete) and open it."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    layout = layout_of(model)
    experts = find_experts(model)
    checksums = []
    blocks = []
    for e in experts:
        layer_blocks = [expert_block(e.module, expert, layout.block_bytes) for expert in range(layout.num_experts)]
        checksums.append([zlib.crc32(block) for block in layer_blocks])
        blocks.append(layer_blocks)
    header = _header_bytes(layout, checksums)
    layout = StoreLayout(**{**layout.__dict__, "data_offset": align_up(len(MAGIC) + 8 + len(header))})
    header = _header_bytes(layout, checksums)  # the offset is in the header; its length does not depend on it
    partial = folder / (FILE_NAME + ".partial")
    with partial.open("wb") as file:
        file.write(MAGIC + struct.pack("<Q", len(header)) + header)
        file.write(bytes(layout.data_offset - file.tell()))
        for layer_blocks in blocks:
            for block in layer_blocks:
                file.write(block)
        file.flush()
        os.fsync(file.fileno())
    partial.replace(folder / FILE_NAME)
    return ExpertStore.open(folder, model)


def _header_bytes(layout: StoreLayout, checksums: list[list[int]]) -> bytes:
    # fixed-width offset so that the header's length does not change when the offset is filled in
    body = {"version": VERSION, "layout": {**layout.to_dict(), "data_offset": f"{layout.data_offset:016d}"},
            "checksums": checksums}
    return json.dumps(body).encode()


class ExpertStore:
    """An open expert store: checked, and read block by block (thread-safe: `os.preadv` at an offset)."""

    def __init__(self, path: Path, layout: StoreLayout, checksums: list[list[int]], direct: bool):
        self.path = path
        self.layout = layout
        self.checksums = checksums  # [L][E] CRC-32 of each block
        self.direct = direct  # reads bypass the page cache
        flags = os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0)
        self._fd = os.open(path, flags)

    @staticmethod
    def open(folder: str | Path, model: nn.Module | None = None, direct: bool = True) -> "ExpertStore":
        """The store in `folder` (or at that file), checked against `model` when given."""
        path = Path(folder)
        path = path / FILE_NAME if path.is_dir() else path
        if not path.is_file():
            raise StoreError(f"no expert store at {path} (write one with write_store, or `--offload-dir` a new folder)")
        layout, checksums = _read_header(path)
        size = path.stat().st_size
        if size != layout.file_bytes:
            raise StoreError(f"{path} is {size} bytes but its header describes {layout.file_bytes} "
                             f"({'truncated' if size < layout.file_bytes else 'trailing data'})")
        if model is not None:
            _check_model(path, layout, checksums, model)
        if direct and not _supports_direct(path, layout):
            warnings.warn(f"{path}: this file system does not allow O_DIRECT; expert reads go through the page "
                          "cache, so their timings include it (put the store on a disk file system to measure "
                          "real reads)", stacklevel=2)
            direct = False
        return ExpertStore(path, layout, checksums, direct)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self):
        self.close()

    def read(self, position: int, expert: int, buffer: memoryview, verify: bool = False) -> None:
        """Read expert `expert` of MoE layer `position` into `buffer` (block_bytes, ALIGN-aligned)."""
        self.read_range(position, expert, 1, buffer)
        if verify:
            self.check_block(position, expert, buffer)

    def check_block(self, position: int, expert: int, buffer: memoryview) -> None:
        """`StoreError` unless `buffer` holds the block the header's checksum describes."""
        if zlib.crc32(buffer[: self.layout.block_bytes]) != self.checksums[position][expert]:
            raise StoreError(f"{self.path}: layer {self.layout.layers[position]}, expert {expert} fails its "
                             "checksum (the store is corrupt)")

    def read_range(self, position: int, first: int, count: int, buffer: memoryview) -> None:
        """Read experts first..first+count-1 of MoE layer `position` (contiguous in the file) in one read."""
        layout = self.layout
        if not (0 <= position < len(layout.layers) and 0 <= first and first + count <= layout.num_experts):
            raise StoreError(f"{self.path}: no blocks for MoE layer {position}, experts {first}..{first + count - 1}")
        size = count * layout.block_bytes
        try:
            got = os.preadv(self._fd, [buffer[:size]], layout.offset(position, first))
        except OSError as error:
            raise StoreError(f"{self.path}: reading layer {layout.layers[position]} failed: "
                             f"{error.strerror or error}") from None
        if got != size:
            raise StoreError(f"{self.path}: layer {layout.layers[position]}: read {got} of {size} bytes "
                             "(the file was truncated)")

    def verify(self) -> None:
        """Read and check every block (a whole-file scan; `open` checks only what is cheap)."""
        buffer = aligned_buffer(self.layout.block_bytes)
        for position in range(len(self.layout.layers)):
            for expert in range(self.layout.num_experts):
                self.read(position, expert, memoryview(buffer), verify=True)

    def tensors(self, buffer, device: torch.device | str = "cpu") -> list[torch.Tensor]:
        """A block in `buffer` as the expert's parameters (views into the buffer on the CPU)."""
        dtype, out, start = self.layout.torch_dtype, [], 0
        item = torch.finfo(dtype).bits // 8
        raw = torch.frombuffer(buffer, dtype=torch.uint8, count=self.layout.payload_bytes)
        for spec in self.layout.params:
            size = spec.numel * item
            out.append(raw[start: start + size].view(dtype).view(spec.shape).to(device))
            start += size
        return out


def aligned_buffer(size: int) -> mmap.mmap:
    """A page-aligned, writable host buffer of `size` bytes (anonymous memory map), as O_DIRECT needs."""
    return mmap.mmap(-1, align_up(max(size, 1)))


def _read_header(path: Path) -> tuple[StoreLayout, list[list[int]]]:
    with path.open("rb") as file:
        prefix = file.read(len(MAGIC) + 8)
        if len(prefix) < len(MAGIC) + 8 or prefix[: len(MAGIC)] != MAGIC:
            raise StoreError(f"{path} is not an expert store (no {MAGIC[:-1].decode()} magic)")
        (length,) = struct.unpack("<Q", prefix[len(MAGIC):])
        if length > _MAX_HEADER_BYTES:
            raise StoreError(f"{path} declares a {length}-byte header (corrupt)")
        raw = file.read(length)
    try:
        body = json.loads(raw)
        if body.get("version") != VERSION:
            raise StoreError(f"{path} is an expert store of version {body.get('version')!r}; this moe_spec reads "
                             f"version {VERSION} (write it again)")
        layout = StoreLayout.from_dict(body["layout"])
        checksums = [[int(c) for c in layer] for layer in body["checksums"]]
    except StoreError:
        raise
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
        raise StoreError(f"{path}: the header is corrupt ({type(error).__name__}: {error})") from None
    if layout.dtype not in _DTYPES or len(checksums) != len(layout.layers) or \
            any(len(layer) != layout.num_experts for layer in checksums) or layout.data_offset % ALIGN:
        raise StoreError(f"{path}: the header is inconsistent (dtype, checksums or alignment)")
    return layout, checksums


def _check_model(path: Path, layout: StoreLayout, checksums: list[list[int]], model: nn.Module) -> None:
    """The store was written from this model: same layout, and each layer's first block matches."""
    expected = layout_of(model, layout.data_offset)
    if expected != layout:
        differs = [k for k in ("model_type", "layers", "num_experts", "params", "dtype")
                   if getattr(expected, k) != getattr(layout, k)]
        raise StoreError(f"{path} was written from another model: its {', '.join(differs)} differ from this "
                         f"{expected.model_type} model's (write a store for this model in another folder)")
    for position, e in enumerate(find_experts(model)):
        if any(p.is_meta for _, p in expert_params(e.module)):
            continue  # already offloaded: nothing here to compare against
        if zlib.crc32(expert_block(e.module, 0, layout.block_bytes)) != checksums[position][0]:
            raise StoreError(f"{path} was written from another checkpoint of this architecture: layer {e.layer}'s "
                             "expert 0 differs from this model's weights (write a store for this model)")


def _supports_direct(path: Path, layout: StoreLayout) -> bool:
    """Whether an O_DIRECT read of one block works on this file system."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    try:
        fd = os.open(path, os.O_RDONLY | flag)
    except OSError:
        return False
    try:
        buffer = aligned_buffer(layout.block_bytes)
        return os.preadv(fd, [memoryview(buffer)], layout.data_offset) == layout.block_bytes
    except OSError:
        return False
    finally:
        os.close(fd)
