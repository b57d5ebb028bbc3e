"""Shared by the offload tests: offloaded tiny models, un-offloaded references, the experts a
reference routes to, and a check that every resident slot holds the weights of the expert it claims."""

from __future__ import annotations

from pathlib import Path

import torch

from moe_spec.core.routing import RoutingRecorder
from moe_spec.offload.expert_store import expert_params, find_experts
from moe_spec.offload.offloaded_experts import ExpertOffload, OffloadConfig, offload_experts
from moe_spec.testing.tiny_models import tiny_model

TOP_K = 2  # every tiny MoE model: 8 experts, top-2, 2 MoE layers
NUM_EXPERTS = 8


def model_of(arch: str, seed: int = 0, eager: bool = False, **kwargs):
    """A tiny model; `eager`: its experts switched to transformers' eager loop."""
    model = tiny_model(arch, seed=seed, **kwargs)
    if eager:
        model.set_experts_implementation("eager")
    return model


def offloaded(arch: str, folder: str | Path, seed: int = 0, eager: bool = False, model_kwargs: dict | None = None,
              **config) -> tuple[torch.nn.Module, ExpertOffload]:
    """A fresh tiny model of `arch` with its experts offloaded to a store in `folder`."""
    model = model_of(arch, seed, eager, **(model_kwargs or {}))
    offload = offload_experts(model, OffloadConfig(folder, **config))
    return model, offload


def assert_served_by_offload(model, offload: ExpertOffload) -> None:
    """The model's own expert weights are gone and the offloaded implementation did the work."""
    for e in find_experts(model):
        assert all(p.is_meta for _, p in expert_params(e.module)), "the experts' weights were freed"
    assert model.config._experts_implementation == offload.implementation
    assert offload.counters.calls > 0, "the offloaded experts implementation ran"


def assert_slots_hold_their_experts(offload: ExpertOffload, reference) -> None:
    """Every (slot -> expert) the caches claim: the slot's tensors equal that expert's weights in
    `reference` (an un-offloaded model of the same checkpoint), and the two maps agree."""
    modules = find_experts(reference)
    for cache, e in zip(offload.caches, modules):
        weights = [p.detach() for _, p in expert_params(e.module)]
        for slot, expert in enumerate(cache.expert_of_slot.tolist()):
            if expert < 0:
                continue
            assert cache.slot_of_expert[expert] == slot, f"layer {e.layer}: slot {slot} and expert {expert} disagree"
            for tensor, weight in zip(cache.slots, weights):
                assert torch.equal(tensor[slot], weight[expert]), \
                    f"layer {e.layer}: slot {slot} claims expert {expert} but holds other weights"
        for expert, slot in enumerate(cache.slot_of_expert.tolist()):
            if slot >= 0:
                assert cache.expert_of_slot[slot] == expert, f"layer {e.layer}: expert {expert} -> slot {slot} dangling"


def routed_experts(reference, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> list[list[int]]:
    """[L] the distinct experts each MoE layer of `reference` (not offloaded) routes one forward to."""
    with RoutingRecorder(reference) as recorder, torch.no_grad():
        reference(input_ids=input_ids, attention_mask=attention_mask)
    experts = recorder.routing().experts  # [L, T, K]
    return [sorted(set(layer.reshape(-1).tolist())) for layer in experts]


def assert_same_logits(got: torch.Tensor, want: torch.Tensor, arch: str, message: str = "",
                       streamed: bool = True) -> None:
    """Bit-identical logits, except GPT-OSS's when a pass may have computed its rows chunk by chunk
    (`streamed`: more experts needed than the cache holds, or the eager base, which always goes row by
    row), which match to float rounding.

    The cause: transformers computes GPT-OSS's gate (`GptOssExperts._apply_gate`) with `torch.sigmoid`
    over interleaved slices of the gate/up projection (`gate_up[..., ::2]`, a strided view), and on
    the CPU that kernel rounds an element differently depending on how many rows the tensor holds
    (a row alone against the same row among 20: up to 1.2e-7 apart; contiguous inputs agree). The
    streamed path computes each chunk of experts' rows in a tensor of that chunk's rows, the
    reference all rows at once. Every other architecture's gate is contiguous, and under grouped_mm
    a pass whose experts are all resident runs the reference's one call (`_in_one_call`): both are
    bit-identical.
    Greedy decoding stays token-identical (test_offload_lossless)."""
    if arch == "gpt_oss" and streamed:
        torch.testing.assert_close(got, want, rtol=0, atol=2e-6, msg=message or None)
    else:
        assert torch.equal(got, want), message
