"""Plain decoding with the experts offloaded, against the ways people offload experts today.

Peers, each its own copy of the same target decoding the same prompts greedily, interleaved
prompt by prompt (one peer after another on each prompt, so drift of the machine hits all alike):

- `resident`: every expert in fast memory, nothing offloaded (the floor);
- `cache:C`: moe_spec's resident cache of C experts per layer over the disk store;
- `no-cache`: every pass reads each expert it uses (C = 0);
- `whole-layer`: every pass reads all experts of each layer, as module-granular offloading does;
- `accelerate-disk`: accelerate's own disk offload of the experts modules (`dispatch_model` with the
  experts on "disk"), the tool a user would reach for. It reads memory-mapped files through the
  page cache, which on a machine with free RAM soon holds them all: say so beside its figure.

Every offloaded peer starts each prompt cold (`ExpertOffload.clear`). Outputs are checked token-
identical to `resident`'s (accelerate included).
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moe_spec.core.engine import SpecDecoder
from moe_spec.core.target import TargetModel
from moe_spec.offload.offloaded_experts import OffloadConfig, offload_experts


@dataclass
class PeerRun:
    name: str
    tokens: int = 0
    ms: float = 0.0
    misses: int = 0
    bytes_read: int = 0
    identical: bool = True
    note: str = ""
    resident_mb: float | None = None
    outputs: list[torch.Tensor] = field(default_factory=list)

    def summary(self, floor: "PeerRun") -> dict:
        tps = 1000.0 * self.tokens / self.ms if self.ms else 0.0
        floor_tps = 1000.0 * floor.tokens / floor.ms if floor.ms else 0.0
        return {"peer": self.name, "tokens_per_s": round(tps, 3), "vs_resident": round(tps / floor_tps, 4) if floor_tps else None,
                "misses_per_token": round(self.misses / self.tokens, 3) if self.tokens else 0.0,
                "mb_read_per_token": round(self.bytes_read / self.tokens / 2**20, 4) if self.tokens else 0.0,
                "identical_to_resident": self.identical, "resident_mb": self.resident_mb, "note": self.note}


def accelerate_disk_offload(model, folder: str | Path):
    """`model` with its routed-experts modules offloaded to disk by accelerate (everything else on the CPU)."""
    from accelerate import dispatch_model

    device_map = {}
    for name, module in model.named_modules():
        if not name or any(name.startswith(prefix + ".") for prefix in device_map):
            continue
        if hasattr(module, "is_concatenated"):
            device_map[name] = "disk"
        elif not any(hasattr(m, "is_concatenated") for m in module.modules()):
            device_map[name] = "cpu"  # the largest subtree without experts
    return dispatch_model(model, device_map=device_map, main_device="cpu", offload_dir=str(folder))


def run_peers(load_model, prompts: list[torch.Tensor], store_folder: str | Path, resident: tuple[int, ...] = (16,),
              max_new_tokens: int = 48, repeats: int = 1, accelerate: bool = True, progress=None) -> list[PeerRun]:
    """Each peer decodes every prompt `repeats` times; `load_model()` returns a fresh target copy."""
    peers: list[tuple[PeerRun, TargetModel, object]] = []
    floor = PeerRun("resident")
    peers.append((floor, TargetModel(load_model()), None))
    configs = [(f"cache:{c}", OffloadConfig(store_folder, resident=c)) for c in resident]
    configs += [("no-cache", OffloadConfig(store_folder, resident=0)),
                ("whole-layer", OffloadConfig(store_folder, resident=0, cache="whole-layer"))]
    for name, config in configs:
        model = load_model()
        offload = offload_experts(model, config)
        summary = offload.summary()  # fast memory the experts take: the cache and its scratch slots
        fast_mb = round(summary["resident_mb"] + summary["scratch_mb"], 3)
        peers.append((PeerRun(name, resident_mb=fast_mb), TargetModel(model, offload=offload), offload))
    scratch = None
    if accelerate:
        scratch = tempfile.TemporaryDirectory(prefix="moe_spec-accelerate-")
        model = accelerate_disk_offload(load_model(), scratch.name)
        peers.append((PeerRun("accelerate-disk", note="memory-mapped through the page cache"), TargetModel(model), None))
    floor.resident_mb = round(sum(p.numel() * p.element_size() for n, p in peers[0][1].model.named_parameters()
                                  if "experts" in n) / 2**20, 3)
    try:
        work = [(r, i, ids) for r in range(repeats) for i, ids in enumerate(prompts)]
        for r, i, ids in (progress(work) if progress else work):
            for run, target, offload in peers:
                if offload is not None:
                    offload.clear()
                start = time.perf_counter()
                result = SpecDecoder(target).generate(ids, max_new_tokens=max_new_tokens)
                run.ms += (time.perf_counter() - start) * 1000
                new = result.sequences[0, ids.shape[1]:]
                run.tokens += int(new.numel())
                run.misses += sum(s.expert_misses for s in result.stats.steps)
                run.bytes_read += sum(s.bytes_read for s in result.stats.steps)
                if r == 0:
                    run.outputs.append(new)
        for run, _, _ in peers[1:]:
            run.identical = all(torch.equal(a, b) for a, b in zip(run.outputs, floor.outputs))
    finally:
        for _, _, offload in peers:
            if offload is not None:
                offload.close()
        if scratch is not None:
            scratch.cleanup()
    return [run for run, _, _ in peers]
