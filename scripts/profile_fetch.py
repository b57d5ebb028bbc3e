"""Add an offload tier's measured fetch cost to an existing profile (the `--offload` stage of
`moe-spec profile`, run on its own so the compute terms stay as measured with every expert resident).

    python scripts/profile_fetch.py --profile moe_spec/assets/default_profile.json \
        --prompts configs/bench/profile.jsonl --out analysis/results/offload/profile_disk.json

Measures m_l(M) from the expert store (written once into --offload-dir), then checks the cost model
with the fetch term on held-out offloaded verify passes (static trees of 0, 2, 8 and 32 nodes, each
prompt from a cold cache), and last measures moe-aware's arms decoding offloaded, on torch's own
thread count (`--arm-settings`; the prior its bandit starts from when experts are offloaded, see
`moe_spec.measure.arm_rates_stage`). `--layer-ahead` reads as `--layer-ahead` runs will, so the
fitted fetch scale prices what a miss adds to a pass read that way. Prints a summary and, last, one
JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from moe_spec.cli.option_types import sampling_setting
from moe_spec.cli.profile import read_prompts
from moe_spec.core.target import TargetModel
from moe_spec.loading import load_drafter, load_target, load_tokenizer, model_folder
from moe_spec.measure.arm_rates_stage import arm_rates_stage
from moe_spec.measure.fetch_profile import fetch_stage
from moe_spec.offload.offloaded_experts import OffloadConfig, offload_experts
from moe_spec.profile.artifact import Profile


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder (default: the embedded target)")
    parser.add_argument("--drafter", default="default")
    parser.add_argument("--profile", required=True, help="the profile whose compute terms to keep")
    parser.add_argument("--prompts", type=Path, required=True)
    parser.add_argument("--max-prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--resident-experts", type=int, default=16, help="C for the held-out check passes")
    parser.add_argument("--offload-dir", default="runs/expert_store/default_target-float32")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--arm-settings", type=sampling_setting, nargs="*",
                        default=[sampling_setting("temperature=0"), sampling_setting("temperature=1")],
                        help="sampling settings to measure moe-aware's arms at, offloaded (none: keep the profile's)")
    parser.add_argument("--arm-prompts", type=int, default=12, help="prompts the arms are measured on")
    parser.add_argument("--layer-ahead", action="store_true",
                        help="read a layer ahead as the run will (`OffloadConfig.layer_ahead`): the fetch scale is "
                             "fitted on passes read that way")
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()  # torch's own: the arms are timed as a user runs them
    torch.set_num_threads(1)
    model = load_target(args.model)
    resident = TargetModel(model)
    profile = Profile.load(args.profile, resident)
    tokenizer = load_tokenizer(args.model)
    prompts = read_prompts(args.prompts, tokenizer, resident.vocab_size)[: args.max_prompts]
    offload = offload_experts(model, OffloadConfig(args.offload_dir, resident=args.resident_experts, layer_ahead=args.layer_ahead))
    target = TargetModel(model, offload=offload)
    drafter = load_drafter(args.drafter, target)
    try:
        profile = fetch_stage(target, drafter, prompts, profile, max_new_tokens=args.max_new_tokens,
                              progress=lambda runs: tqdm(runs, desc="fetch check", file=sys.stderr))
        if args.arm_settings:
            torch.set_num_threads(threads)
            arm_prompts = read_prompts(args.prompts, tokenizer, resident.vocab_size)[: args.arm_prompts]
            with tqdm(total=len(arm_prompts) * len(args.arm_settings), desc="arm rates, offloaded", file=sys.stderr) as bar:
                entries = arm_rates_stage(target, drafter, profile, arm_prompts, args.arm_settings, 48,
                                          tick=lambda: bar.update(1))
            profile = dataclasses.replace(profile, arm_rates=tuple(
                e for e in profile.arm_rates if e.resident_experts is None) + entries)
    finally:
        offload.close()
    profile.details.setdefault("measurement", {})["fetch_stage_model"] = str(model_folder(args.model))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    profile.save(args.out)
    report = profile.details["fetch_cost_report"]
    fetch = report["fetch_cost"]
    print("fetch cost m(M), ms, per layer:")
    for layer, row in enumerate(fetch["ms"]):
        print(f"  layer {layer}: " + "  ".join(f"{c}:{v:.2f}" for c, v in zip(fetch["counts"], row)))
    print(f"passes: {report['fit_passes']} to refit the compute terms, {report['heldout_passes']} held out")
    refit = report["refit_compute"]
    print(f"reads {report['reading']}: fetch scale {refit['fetch_scale']:.3f}, overflow {refit['overflow_ms']:.3f} ms "
          f"per expert beyond {refit['capacity']} slots, base {refit['base_ms']:.2f} ms")
    keys = ("error_refit_with_fetch_term", "error_refit_without_fetch_scale", "error_refit_without_overflow_term",
            "error_resident_compute_with_fetch_term", "error_compute_only")
    for key in keys:
        e = report[key]
        print(f"{key:<38} n={e['n']}  median {e['median']:.1%}  p90 {e['p90']:.1%}  signed mean {e['mean_signed']:+.1%}")
    print(f"share of verify time in fetches: {report['share_of_time_in_fetch']:.1%}")
    line = {"command": "profile_fetch", "out": str(args.out),
            "reading": report["reading"], "fetch_scale": refit["fetch_scale"], "overflow_ms": refit["overflow_ms"],
            **{k: report[k]["median"] for k in keys},
            "share_of_time_in_fetch": report["share_of_time_in_fetch"], "passes": report["passes"]}
    print(json.dumps(line))
    return line


if __name__ == "__main__":
    main()
