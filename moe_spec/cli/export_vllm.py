"""`moe-spec export-vllm`: a head and an MoE-aware speculation schedule, as a folder vLLM takes as it is.

    moe-spec export-vllm --model /models/Qwen3-30B-A3B --drafter /models/Qwen3-30B-A3B-EAGLE3 \
        --profile runs/qwen3/profile.json --prompts my_prompts.jsonl --out runs/qwen3/vllm
    vllm serve /models/Qwen3-30B-A3B --speculative-config "$(cat runs/qwen3/vllm/speculative_config.json)"

See `moe_spec.integrations.vllm.export`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tqdm import tqdm

from moe_spec.cli.default_method import profile_path
from moe_spec.cli.model_options import add_model_arguments, resolve_model_options
from moe_spec.cli.option_types import positive_int
from moe_spec.cli.profile import read_prompts
from moe_spec.core.target import TargetModel
from moe_spec.errors import InputError
from moe_spec.integrations.vllm.export import EngineMeasure, export_for_vllm
from moe_spec.integrations.vllm.step_costs import EngineCosts
from moe_spec.loading import load_drafter, load_target, load_tokenizer, model_folder
from moe_spec.profile.artifact import Profile

EMBEDDED_PROMPTS = Path(__file__).resolve().parents[2] / "configs" / "bench" / "profile.jsonl"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model folder (default: the embedded target)")
    parser.add_argument("--drafter", default="default",
                        help="an EAGLE-3 head folder, 'default' (the embedded head) or 'lookup' (vLLM's n-gram proposer)")
    parser.add_argument("--profile", default=None,
                        help="profile JSON of this target (default: the shipped or cached one of this target and drafter)")
    parser.add_argument("--prompts", type=Path, default=None,
                        help="JSON-lines prompts to measure chain acceptance on (default for the embedded pair: "
                             "its profiling prompts)")
    parser.add_argument("--out", type=Path, required=True, help="folder to write the head and the configs into")
    parser.add_argument("--max-k", type=positive_int, default=5, help="longest chain considered")
    parser.add_argument("--max-batch", type=positive_int, default=256, help="largest batch size scheduled (vLLM's max_num_seqs)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=48, help="tokens decoded per prompt to measure acceptance")
    parser.add_argument("--engine-costs", default=None,
                        help="price the schedule by vLLM's own step times: 'measure' (start vLLM once per K in "
                             "0..max-k and time each batch size of --engine-batch-sizes; written to "
                             "OUT/engine_costs.json) or such a file (default: the profile's prices)")
    parser.add_argument("--engine-batch-sizes", type=batch_sizes, default=(1, 4, 16),
                        help="batch sizes timed with --engine-costs measure")
    parser.add_argument("--vllm-python", type=Path, default=Path(".venv-vllm/bin/python"),
                        help="python of vLLM's own environment (`make vllm-env`), for --engine-costs measure")
    add_model_arguments(parser)


def batch_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated batch sizes, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be >= 1, got {text!r}")
    return sizes


def run(args: argparse.Namespace) -> dict:
    resolve_model_options(args)
    model_dir = model_folder(args.model)
    target = TargetModel(load_target(model_dir, args.dtype, device=args.device, device_map=args.device_map))
    drafter = load_drafter(args.drafter, target)
    if drafter is None:
        raise InputError("--drafter none exports nothing to speculate with; name a head folder, 'default' or 'lookup'")
    found = profile_path(args.model, args.drafter, args.profile, target)
    if found is None:
        raise InputError(f"no profile of this target and drafter: make one with `moe-spec profile --model "
                         f"{args.model or '<model>'} --drafter {args.drafter} --prompts <prompts.jsonl>`, or pass --profile")
    profile = Profile.load(found, target)
    prompts_file = args.prompts or (EMBEDDED_PROMPTS if args.model is None else None)
    if prompts_file is None:
        raise InputError("--prompts is needed for a model other than the embedded target")
    prompts = read_prompts(prompts_file, load_tokenizer(model_dir), target.vocab_size)
    engine_costs = measure_engine = None
    if args.engine_costs == "measure":
        measure_engine = EngineMeasure(model_dir, args.vllm_python, args.engine_batch_sizes)
        print(f"timing vLLM's steps: {args.max_k + 1} engines (K = 0..{args.max_k}), batch sizes "
              f"{list(args.engine_batch_sizes)}; each engine starts in 10-30 s", file=sys.stderr)
    elif args.engine_costs is not None:
        engine_costs = EngineCosts.load(Path(args.engine_costs))
    report = export_for_vllm(target, drafter, profile, prompts, args.out, args.max_k, args.max_batch,
                             args.max_new_tokens,
                             progress=lambda items: tqdm(items, desc="chain acceptance", file=sys.stderr, leave=False),
                             engine_costs=engine_costs, measure_engine=measure_engine)
    config = report["speculative_config"]
    print(f"wrote {args.out}: {config['method']}, K per batch size {config['num_speculative_tokens_per_batch_size']}",
          file=sys.stderr)
    for row in report["by_batch_size"]:
        print(f"  B = {row['rows']:>3}: K = {row['length']}  predicted {row['speedup']:.2f}x no speculation", file=sys.stderr)
    speculate = any(length > 0 for *_, length in config["num_speculative_tokens_per_batch_size"])
    if not speculate:  # vLLM's speculative machinery costs its steps even where it drafts nothing
        print("  no batch size pays for speculation: serve this target without --speculative-config", file=sys.stderr)
    summary = {"command": "export-vllm", "out": str(args.out), "speculative_config": config, "speculate": speculate,
               "reach": report["chain_acceptance"]["reach"], "profile": str(found), "priced_by": report["priced_by"]}
    print(json.dumps(summary))  # the full report is OUT/schedule.json
    return summary
