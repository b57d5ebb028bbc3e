"""Fit the head routing predictor and write it, with its held-out scores, into an existing profile.

    python scripts/fit_head_routing.py --profile moe_spec/assets/default_profile.json \
        --prompts configs/bench/profile.jsonl --out moe_spec/assets/default_profile.json

Decodes the profile's prompts with node features, fits on the prompts the profile's token table was
fitted on, scores the head predictor and the token table on the held-out ones (per MoE layer: node
recall / precision, tree-union recall / precision), keeps the better (`head_routing_stage`), and
times the predictor on 10- and 30-node trees. Prints a table and, last, one JSON line. Every other
section of the profile is written back unchanged.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from moe_spec.cli.profile import read_prompts
from moe_spec.core.target import TargetModel
from moe_spec.loading import load_drafter, load_target, load_tokenizer
from moe_spec.measure.head_routing_stage import head_routing_stage
from moe_spec.profile.artifact import Profile


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder (default: the embedded target)")
    parser.add_argument("--drafter", default="default")
    parser.add_argument("--profile", required=True, help="the profile to add the predictor to")
    parser.add_argument("--prompts", type=Path, required=True, help="the prompts the profile was made on")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    target = TargetModel(load_target(args.model, dtype="float32"))
    profile = Profile.load(args.profile, target)
    prompts = read_prompts(args.prompts, load_tokenizer(args.model), target.vocab_size)
    drafter = load_drafter(args.drafter, target)
    bar = tqdm(total=len(prompts), desc="decoding", file=sys.stderr)
    profile = head_routing_stage(target, drafter, prompts, profile, max_new_tokens=args.max_new_tokens, tick=bar.update)
    bar.close()
    profile.save(args.out)
    section = profile.head_routing
    report = section.report
    head, token = report["held_out"]["head"], report["held_out"]["token_table"]
    print(f"held out: prompts {report['held_out_prompts']}, {head['nodes']} drafted nodes in {head['trees']} trees; "
          f"fitted on {report['fit_nodes']} nodes in {report['fit_seconds']:.1f} s")
    print("layer | node recall (= precision)  head  table | union recall  head  table | union precision  head  table")
    for layer in range(len(head["node_recall"])):
        print(f"{layer:5d} | {'':25} {head['node_recall'][layer]:.3f}  {token['node_recall'][layer]:.3f} | "
              f"{'':12} {head['union_recall'][layer]:.3f}  {token['union_recall'][layer]:.3f} | "
              f"{'':15} {head['union_precision'][layer]:.3f}  {token['union_precision'][layer]:.3f}")
    print(f"union F1 (mean over layers): head {head['union_f1']:.4f}, table {token['union_f1']:.4f}; "
          f"the profile keeps: {section.keeps.value}")
    cost = {n: _predict_ms(profile, n) for n in (10, 30)}
    print("predictor per step: " + ", ".join(f"{n} nodes {ms:.3f} ms" for n, ms in cost.items()))
    line = {"command": "fit_head_routing", "out": str(args.out), "keeps": section.keeps.value,
            "union_f1_head": head["union_f1"], "union_f1_table": token["union_f1"],
            "predict_ms": {str(n): ms for n, ms in cost.items()}}
    print(json.dumps(line))
    return line


def _predict_ms(profile: Profile, nodes: int, repeats: int = 200) -> float:
    """Median ms of the head predictor's priced sets for one tree of `nodes` drafted nodes."""
    predictor, table = profile.head_routing.predictor, profile.expert_table
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(nodes + 1, predictor.hidden_size, generator=generator)
    tokens = torch.randint(predictor.vocab_size, (nodes + 1,), generator=generator)
    depths = torch.cat([torch.zeros(1, dtype=torch.long), torch.ones(nodes, dtype=torch.long)])
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        predictor.predict_onehot(features, tokens, depths, table)
        times.append((time.perf_counter() - start) * 1000)
    return sorted(times)[len(times) // 2]


if __name__ == "__main__":
    main()
