"""The expert store: what is written reads back exactly, and a store that is truncated, corrupt,
foreign or from another checkpoint is refused with a `StoreError` that names the problem."""

from __future__ import annotations

import json
import os
import struct
import warnings
from pathlib import Path

import pytest
import torch

from moe_spec.errors import InputError, MoeSpecError
from moe_spec.offload.expert_store import (
    ALIGN, FILE_NAME, MAGIC, ExpertStore, StoreError, aligned_buffer, expert_params, find_experts, write_store,
)
from moe_spec.offload.offloaded_experts import OffloadConfig, offload_experts
from moe_spec.testing.helpers import PLAIN_PROMPT
from moe_spec.testing.tiny_models import MOE_ARCHITECTURES, tiny_model

IDS = torch.tensor([PLAIN_PROMPT])


@pytest.fixture
def opened():
    """`opened(store)`: the store, closed at teardown."""
    stores = []

    def keep(store):
        stores.append(store)
        return store

    yield keep
    for store in stores:
        store.close()


def written(model, folder: Path) -> Path:
    write_store(model, folder).close()
    return folder / FILE_NAME


def flip_byte(path: Path, offset: int) -> None:
    with path.open("r+b") as file:
        file.seek(offset)
        value = file.read(1)[0]
        file.seek(offset)
        file.write(bytes([value ^ 0xFF]))


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_every_block_reads_back_as_the_models_expert_weights(tmp_path, opened, arch):
    model = tiny_model(arch, seed=3)
    store = opened(write_store(model, tmp_path))
    assert store.path == tmp_path / FILE_NAME
    layout = store.layout
    experts = find_experts(model)
    assert layout.layers == tuple(e.layer for e in experts) and layout.num_experts == 8
    assert layout.block_bytes % ALIGN == 0 and layout.data_offset % ALIGN == 0
    assert store.path.stat().st_size == layout.data_offset + len(experts) * 8 * layout.block_bytes
    buffer = aligned_buffer(layout.block_bytes)
    for position, e in enumerate(experts):
        params = expert_params(e.module)
        assert [p.name for p in layout.params] == [name for name, _ in params]
        for expert in range(layout.num_experts):
            store.read(position, expert, memoryview(buffer), verify=True)
            blocks = store.tensors(buffer)
            assert len(blocks) == len(params)
            for block, (name, weight) in zip(blocks, params):
                assert torch.equal(block, weight.detach()[expert]), f"layer {e.layer} expert {expert} {name}"
    # a contiguous range reads the same blocks in one go
    whole = aligned_buffer(layout.num_experts * layout.block_bytes)
    store.read_range(1, 2, 5, memoryview(whole))
    for i, expert in enumerate(range(2, 7)):
        block = memoryview(whole)[i * layout.block_bytes: (i + 1) * layout.block_bytes]
        for got, (_, weight) in zip(store.tensors(block), expert_params(experts[1].module)):
            assert torch.equal(got, weight.detach()[expert])
    store.verify()
    # and it opens again, checked against the model it came from
    again = opened(ExpertStore.open(tmp_path, model))
    assert again.layout == layout and again.checksums == store.checksums


def test_a_bfloat16_store_round_trips(tmp_path, opened):
    model = tiny_model("qwen3_moe", dtype=torch.bfloat16)
    store = opened(write_store(model, tmp_path))
    assert store.layout.dtype == "bfloat16"
    buffer = aligned_buffer(store.layout.block_bytes)
    e = find_experts(model)[1]
    store.read(1, 5, memoryview(buffer), verify=True)
    for got, (_, weight) in zip(store.tensors(buffer), expert_params(e.module)):
        assert got.dtype == torch.bfloat16 and torch.equal(got, weight.detach()[5])
    store.verify()


def test_a_truncated_store_is_refused_as_truncated(tmp_path):
    model = tiny_model("mixtral")
    path = written(model, tmp_path)
    os.truncate(path, path.stat().st_size - 1)
    with pytest.raises(StoreError, match="truncated"):
        ExpertStore.open(tmp_path, model)
    os.truncate(path, 100)  # inside the header
    with pytest.raises(StoreError):
        ExpertStore.open(tmp_path, model)
    with pytest.raises(StoreError):  # offloading refuses it too, and leaves the model as it was
        offload_experts(model, OffloadConfig(tmp_path))
    assert not any(p.is_meta for p in model.parameters())


def test_trailing_data_is_refused(tmp_path):
    model = tiny_model("olmoe")
    path = written(model, tmp_path)
    with path.open("ab") as file:
        file.write(b"\0" * ALIGN)
    with pytest.raises(StoreError, match="trailing data"):
        ExpertStore.open(tmp_path, model)


def test_corrupt_header_bytes_are_refused(tmp_path):
    model = tiny_model("qwen2_moe")
    path = written(model, tmp_path)
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[len(MAGIC): len(MAGIC) + 8])
    start = len(MAGIC) + 8
    header = raw[start: start + length]
    cases = {
        "json broken": raw[:start] + b"[" + header[1:] + raw[start + length:],
        "length beyond the header": raw[:len(MAGIC)] + struct.pack("<Q", length + 7) + raw[start:],
        "length shorter than the header": raw[:len(MAGIC)] + struct.pack("<Q", length - 9) + raw[start:],
        "huge length": raw[:len(MAGIC)] + struct.pack("<Q", 2**62) + raw[start:],
        "not utf-8": raw[:start + 5] + b"\xff\xfe" + raw[start + 7:],
    }
    body = json.loads(header)
    for name, change in {
        "version 2": lambda b: b.update(version=2),
        "no layout": lambda b: b.pop("layout"),
        "unknown dtype": lambda b: b["layout"].update(dtype="int8"),
        "checksums of one layer missing": lambda b: b["checksums"].pop(),
        "misaligned data": lambda b: b["layout"].update(data_offset=f"{4095:016d}"),
        "layout not an object": lambda b: b.update(layout=[1, 2]),
    }.items():
        edited = json.loads(header)
        change(edited)
        text = json.dumps(edited).encode()
        cases[name] = MAGIC + struct.pack("<Q", len(text)) + text + raw[start + length:]
    assert body["version"] == 1
    for name, content in cases.items():
        path.write_bytes(content)
        with pytest.raises(StoreError) as caught:
            ExpertStore.open(tmp_path, model)
        assert str(path) in str(caught.value), name
        if name == "version 2":
            assert "version" in str(caught.value)


def test_every_single_byte_change_in_the_header_is_a_store_error_or_harmless(tmp_path, opened):
    """No corruption of the header escapes as another exception type (KeyError, AttributeError, ...)."""
    model = tiny_model("gpt_oss")
    path = written(model, tmp_path)
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[len(MAGIC): len(MAGIC) + 8])
    refused = 0
    for offset in range(0, len(MAGIC) + 8 + length, 3):
        for value in (0x00, 0x22, 0x2D, 0x31, 0x5B, 0x7D):
            changed = bytearray(raw)
            changed[offset] = value
            path.write_bytes(bytes(changed))
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    opened(ExpertStore.open(tmp_path, model))
            except StoreError:
                refused += 1
    assert refused > 0


def test_random_bytes_are_not_an_expert_store(tmp_path):
    model = tiny_model("mixtral")
    generator = torch.Generator().manual_seed(0)
    (tmp_path / FILE_NAME).write_bytes(torch.randint(0, 256, (3 * ALIGN,), generator=generator,
                                                     dtype=torch.uint8).numpy().tobytes())
    with pytest.raises(StoreError, match="not an expert store"):
        ExpertStore.open(tmp_path, model)
    (tmp_path / FILE_NAME).write_bytes(b"")
    with pytest.raises(StoreError, match="not an expert store"):
        ExpertStore.open(tmp_path / FILE_NAME)
    with pytest.raises(StoreError, match="no expert store"):
        ExpertStore.open(tmp_path / "elsewhere", model)


@pytest.mark.parametrize(("written_from", "opened_with"), [("mixtral", "phimoe"), ("olmoe", "qwen3_moe"),
                                                            ("qwen3_moe", "deepseek_v3"), ("gpt_oss", "mixtral")])
def test_a_store_of_another_architecture_is_refused(tmp_path, written_from, opened_with):
    written(tiny_model(written_from), tmp_path)
    model = tiny_model(opened_with)
    with pytest.raises(StoreError, match="another model") as caught:
        ExpertStore.open(tmp_path, model)
    assert "model_type" in str(caught.value)
    with pytest.raises(StoreError, match="another"):
        offload_experts(model, OffloadConfig(tmp_path))
    assert not any(p.is_meta for p in model.parameters()), "the refused offload changed nothing"


def test_a_store_of_another_checkpoint_of_the_same_architecture_is_refused(tmp_path, opened):
    written(tiny_model("qwen3_moe", seed=0), tmp_path)
    other = tiny_model("qwen3_moe", seed=1)
    with pytest.raises(StoreError, match="another checkpoint"):
        ExpertStore.open(tmp_path, other)
    with pytest.raises(StoreError, match="another"):
        offload_experts(other, OffloadConfig(tmp_path))
    # the same checkpoint, loaded again, is accepted
    opened(ExpertStore.open(tmp_path, tiny_model("qwen3_moe", seed=0)))
    # other shapes of the same architecture are another model
    with pytest.raises(StoreError, match="another model"):
        ExpertStore.open(tmp_path, tiny_model("qwen3_moe", moe_intermediate_size=24))
    with pytest.raises(StoreError, match="another model"):
        ExpertStore.open(tmp_path, tiny_model("qwen3_moe", dtype=torch.bfloat16))


def test_a_flipped_byte_inside_a_block_fails_verification(tmp_path, opened):
    model = tiny_model("deepseek_v3")
    path = written(model, tmp_path)
    layout = opened(ExpertStore.open(tmp_path, model)).layout
    flip_byte(path, layout.offset(1, 6) + 17)  # not expert 0: `open` checks only what is cheap
    store = opened(ExpertStore.open(tmp_path, model))
    with pytest.raises(StoreError, match="layer 1, expert 6 fails its checksum"):
        store.verify()
    buffer = memoryview(aligned_buffer(layout.block_bytes))
    store.read(1, 6, buffer)  # unverified reads return the bytes as they are
    with pytest.raises(StoreError, match="checksum"):
        store.read(1, 6, buffer, verify=True)
    store.read(1, 5, buffer, verify=True)  # its neighbours are intact
    store.read(0, 6, buffer, verify=True)


def test_the_checksums_recorded_for_expert_0_identify_the_checkpoint(tmp_path, opened):
    """`open` compares the header's CRC of each layer's expert 0 with the model's weights (cheap:
    no block is read), so an edited checksum is refused; a corrupt block 0 is `verify`'s to find."""
    model = tiny_model("mixtral")
    path = written(model, tmp_path)
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[len(MAGIC): len(MAGIC) + 8])
    start = len(MAGIC) + 8
    body = json.loads(raw[start: start + length])
    crc = body["checksums"][1][0]
    body["checksums"][1][0] = crc ^ 1
    text = json.dumps(body).encode()
    path.write_bytes(MAGIC + struct.pack("<Q", len(text)) + text + raw[start + length:])
    with pytest.raises(StoreError, match="another checkpoint.*layer 1's expert 0"):
        ExpertStore.open(tmp_path, model)
    path.write_bytes(raw)
    layout = opened(ExpertStore.open(tmp_path, model)).layout
    flip_byte(path, layout.offset(0, 0) + 3)
    store = opened(ExpertStore.open(tmp_path, model))
    with pytest.raises(StoreError, match="layer 0, expert 0 fails its checksum"):
        store.verify()


def test_verify_reads_catch_a_corrupt_block_during_a_forward(tmp_path):
    model = tiny_model("qwen3_moe")
    path = written(model, tmp_path)
    reference = tiny_model("qwen3_moe")
    with torch.no_grad():
        want = reference(IDS).logits
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layout = ExpertStore.open(tmp_path).layout
    for expert in range(1, 8):  # every expert but 0 of layer 0: whichever the prompt routes to
        flip_byte(path, layout.offset(0, expert) + 2)
    unchecked_model = tiny_model("qwen3_moe")
    unchecked = offload_experts(unchecked_model, OffloadConfig(tmp_path, resident=8))
    try:
        with torch.no_grad():
            assert not torch.equal(unchecked_model(IDS).logits, want), "the corruption changes the output"
    finally:
        unchecked.close()
    checked_model = tiny_model("qwen3_moe")
    checked = offload_experts(checked_model, OffloadConfig(tmp_path, resident=8, verify_reads=True))
    try:
        with pytest.raises(StoreError, match="checksum"), torch.no_grad():
            checked_model(IDS)
    finally:
        checked.close()


def test_verify_reads_catch_a_corrupt_block_with_whole_layer_fetching(tmp_path):
    model = tiny_model("mixtral")
    offload = offload_experts(model, OffloadConfig(tmp_path, cache="whole-layer", verify_reads=True))
    try:
        flip_byte(offload.store.path, offload.store.layout.offset(1, 3) + 10)
        with pytest.raises(StoreError, match="checksum"), torch.no_grad():
            model(IDS)
    finally:
        offload.close()


def test_a_dense_model_has_no_experts_to_store_or_offload(tmp_path):
    for arch in ("llama", "qwen3"):
        model = tiny_model(arch)
        with pytest.raises(StoreError, match="dense"):
            write_store(model, tmp_path)
        with pytest.raises(InputError, match="dense"):
            offload_experts(model, OffloadConfig(tmp_path))
    assert not (tmp_path / FILE_NAME).exists()


def test_offloading_reuses_an_existing_store_of_the_same_checkpoint(tmp_path):
    path = written(tiny_model("phimoe"), tmp_path)
    before = path.stat().st_mtime_ns, path.stat().st_ino
    model = tiny_model("phimoe")
    offload = offload_experts(model, OffloadConfig(tmp_path))
    try:
        assert (path.stat().st_mtime_ns, path.stat().st_ino) == before, "the store was opened, not rewritten"
        with torch.no_grad():
            assert torch.equal(model(IDS).logits, tiny_model("phimoe")(IDS).logits)
        with pytest.raises(InputError, match="already offloaded"):
            offload_experts(model, OffloadConfig(tmp_path / "second"))
    finally:
        offload.close()


def test_without_o_direct_reads_fall_back_to_buffered_reads_with_a_warning(tmp_path, opened, monkeypatch):
    model = tiny_model("olmoe")
    write_store(model, tmp_path).close()
    monkeypatch.delattr(os, "O_DIRECT", raising=False)  # as on a system without it
    with pytest.warns(UserWarning, match="O_DIRECT"):
        store = opened(ExpertStore.open(tmp_path, model))
    assert not store.direct
    store.verify()
    buffer = aligned_buffer(store.layout.block_bytes)
    store.read(1, 4, memoryview(buffer))
    for got, (_, weight) in zip(store.tensors(buffer), expert_params(find_experts(model)[1].module)):
        assert torch.equal(got, weight.detach()[4])


def test_store_errors_are_moe_spec_errors():
    assert issubclass(StoreError, MoeSpecError)
