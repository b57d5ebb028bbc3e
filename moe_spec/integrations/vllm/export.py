"""`export_for_vllm`: a folder vLLM takes as it is, with a speculation schedule from moe_spec's cost model.

    OUT/head/                      the EAGLE-3 head in the speculators layout (vLLM's `method: eagle3`)
    OUT/speculative_config.json    `--speculative-config` / `LLM(speculative_config=...)` as it is
    OUT/schedule.json              how the schedule was chosen: chain acceptance, predicted step times
    OUT/proposer.json, OUT/proposer_config.json   (`lookup` only) moe_spec's own proposer for vLLM's
                                   `custom_class` method, which sizes each request's chain every step

The schedule is vLLM's `num_speculative_tokens_per_batch_size`: for each batch size B, the chain length
K of most tokens per ms under this target's measured verify cost on this machine, the expert union that
B x (K + 1) tokens load included (`moe_spec.policy.engine_schedule`), against the acceptance chains of
this drafter reach on the given prompts (`moe_spec.measure.chain_reach`). The step cost is the
profile's, or vLLM's own (`step_costs`: measured by running the engine, OUT/engine_costs.json). A `lookup` drafter exports
vLLM's own n-gram proposer (`method: ngram`) under the same schedule.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from moe_spec.core.target import TargetModel
from moe_spec.drafters.eagle import EagleDrafter
from moe_spec.drafters.head_layouts import save_head
from moe_spec.drafters.lookup import LookupDrafter
from moe_spec.errors import InputError
from moe_spec.integrations.vllm.step_costs import EngineCosts, fit, measure
from moe_spec.measure.chain_reach import ChainCounts, chain_counts
from moe_spec.policy.batch_chains import share_from_union
from moe_spec.policy.engine_schedule import schedule, vllm_ranges
from moe_spec.profile.artifact import Profile

SCHEDULE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # batch sizes listed in schedule.json


def speculative_config(method: str, head: Path | None, ranges: list[list[int]], drafter=None) -> dict:
    """vLLM's speculative config for `ranges` ([start, end, K] per batch-size range)."""
    longest = max(k for _, _, k in ranges)
    config = {"method": method, "num_speculative_tokens": max(longest, 1),
              "num_speculative_tokens_per_batch_size": ranges}
    if head is not None:
        config["model"] = str(head.resolve())
    if isinstance(drafter, LookupDrafter):
        config.update(prompt_lookup_max=drafter.max_ngram, prompt_lookup_min=drafter.min_ngram)
    return config


@dataclass(frozen=True)
class EngineMeasure:
    """How to measure vLLM's own step costs for the schedule (`step_costs`): the target's folder, vLLM's
    environment's python, the batch sizes to time and the tokens each prompt decodes."""

    model: Path
    vllm_python: Path
    batch_sizes: tuple[int, ...] = (1, 4, 16)
    max_tokens: int = 32
    repeats: int = 2


def export_for_vllm(target: TargetModel, drafter, profile: Profile, prompts: Sequence[torch.Tensor], out: Path,
                    max_length: int = 5, max_rows: int = 256, max_new_tokens: int = 48, progress=None,
                    engine_costs: EngineCosts | None = None, measure_engine: EngineMeasure | None = None) -> dict:
    """Measure the drafter's chain acceptance, choose K per batch size, write `out`; returns
    schedule.json's content. Steps are priced by the profile, or by vLLM's own step costs: given
    (`engine_costs`) or measured now with the exported drafter (`measure_engine`, written to
    OUT/engine_costs.json)."""
    if not isinstance(drafter, (EagleDrafter, LookupDrafter)):
        raise InputError("export-vllm exports an EAGLE-3 head (a head folder or 'default') or 'lookup' "
                         f"(vLLM's n-gram proposer); got {type(drafter).__name__}")
    if not prompts:
        raise InputError("export-vllm needs prompts to measure how far chains get accepted")
    counts: ChainCounts = chain_counts(target, drafter, prompts, max_length, max_new_tokens, progress=progress)
    out.mkdir(parents=True, exist_ok=True)
    head = None
    if isinstance(drafter, EagleDrafter):
        head = out / "head"
        save_head(drafter.head, head, "speculators", dtype=drafter.head.dtype)
    method = "eagle3" if head is not None else "ngram"
    if measure_engine is not None:
        def fixed(length: int) -> dict:
            config = speculative_config(method, head, [[1, 1, length]], drafter)
            del config["num_speculative_tokens_per_batch_size"]
            return config

        steps = measure(measure_engine.model, fixed, [p.tolist() for p in prompts], range(max_length + 1),
                        measure_engine.batch_sizes, measure_engine.max_tokens, measure_engine.vllm_python,
                        measure_engine.repeats)
        engine_costs = fit(profile, steps)
        (out / "engine_costs.json").write_text(json.dumps(engine_costs.to_dict(), indent=2) + "\n")
    choices = schedule(profile, counts.reach, max_rows, engine_costs.step_cost(profile) if engine_costs else None)
    ranges = vllm_ranges(choices)
    config = speculative_config(method, head, ranges, drafter)
    (out / "speculative_config.json").write_text(json.dumps(config, indent=2) + "\n")
    report = {
        "speculative_config": config,
        "priced_by": "vllm step costs" if engine_costs is not None else "profile",
        "engine_costs": engine_costs.to_dict() if engine_costs is not None else None,
        "chain_acceptance": {"steps": counts.steps, "accepted_per_position": list(counts.accepted_per_position),
                             "reach": [round(r, 4) for r in counts.reach], "prompts": len(prompts),
                             "max_new_tokens": max_new_tokens},
        "by_batch_size": [{**asdict(c), "rates": [round(r, 5) for r in c.rates], "speedup": round(c.speedup, 3)}
                          for c in choices if c.rows in SCHEDULE_SIZES],
        "cost_model": profile.cost_model.to_dict(),
        "hardware": profile.hardware,
    }
    (out / "schedule.json").write_text(json.dumps(report, indent=2) + "\n")
    if isinstance(drafter, LookupDrafter):
        write_proposer(out, drafter, profile, counts, max_length)
    return report


PROPOSER_CLASS = "moe_spec.integrations.vllm.proposer.MoeSpecProposer"


def write_proposer(out: Path, drafter: LookupDrafter, profile: Profile, counts: ChainCounts, max_length: int) -> None:
    """proposer.json (what `MoeSpecProposer` reads through $MOE_SPEC_PROPOSER) and the speculative config
    that selects it."""
    fingerprint, curve = profile.fingerprint, profile.unique_experts_curve
    experts = int(fingerprint.get("num_experts") or 0)
    share = None
    if curve is not None and experts:  # each token's share of new experts, from the profile's largest measured size
        share = share_from_union(curve.random[-1], curve.sizes[-1], experts).tolist()
    document = {"reach": list(counts.reach), "max_length": max_length, "cost_model": profile.cost_model.to_dict(),
                "num_experts": experts, "top_k": int(fingerprint.get("top_k") or 0), "new_expert_share": share,
                "lookup": {"max_ngram": drafter.max_ngram, "min_ngram": drafter.min_ngram}}
    (out / "proposer.json").write_text(json.dumps(document, indent=2) + "\n")
    config = {"method": "custom_class", "model": PROPOSER_CLASS, "num_speculative_tokens": max_length}
    (out / "proposer_config.json").write_text(json.dumps(config, indent=2) + "\n")
