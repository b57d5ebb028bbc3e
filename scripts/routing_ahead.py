"""What reading experts ahead could know, replayed on the embedded pair's decoding passes (every
expert resident), one command per question:

    python scripts/routing_ahead.py pregate --nodes 0      # plain decoding: one token a pass
    python scripts/routing_ahead.py pregate --nodes 4      # EAGLE-2 trees of 4 nodes
    python scripts/routing_ahead.py eviction --nodes 0 --resident-experts 16

`pregate`: how well a MoE layer's router, applied to the previous MoE layer's hidden states, picks
the experts that layer then routes to (what `OffloadConfig(layer_ahead=True)` reads ahead), per MoE
layer after the first, over the decoding passes (the prefill left out): recall (the share of the
distinct experts the layer needed that were picked), precision (the share of the picks it needed),
and the recall of "the experts the previous layer used" as the naive guess.

`eviction`: how many reads a better eviction could save. The experts each layer routes to, pass by
pass, replayed through a cache of C per layer under LRU, LFU and Belady's offline optimum (evict
the expert whose next use is farthest: no policy that does not know the future does better), each
prompt from a cold cache; a pass needing more than C in a layer reads the rest without keeping them
(as the offload's overflow does). Experts read per generated token, all passes and the decoding
passes alone.

Each prints a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import OrderedDict
from pathlib import Path

import torch

from moe_spec.cli.profile import read_prompts
from moe_spec.core.drafting import EAGLE2_BUDGET
from moe_spec.core.engine import SpecDecoder
from moe_spec.core.routing import find_routers
from moe_spec.core.target import TargetModel
from moe_spec.loading import load_drafter, load_target, load_tokenizer
from moe_spec.policy.static import StaticController

POLICIES = ("lru", "lfu", "belady")


class PregateTally:
    """Forward hooks on every router: at the last one of each pass, each layer's router is applied
    (its `forward`, so no hook runs) to the previous layer's router input, and the picks compared."""

    def __init__(self, routers, max_tokens: int):
        self.routers, self.max_tokens = routers, max_tokens
        self.seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # position -> (router input [T, D], picks [T, K])
        count = len(routers)
        self.needed, self.hit, self.picked, self.naive_hit = ([0] * count for _ in range(4))

    def hook_for(self, position: int):
        def hook(module, inputs, output):
            hidden = inputs[0].detach()
            self.seen[position] = (hidden.reshape(-1, hidden.shape[-1]), output[2].detach().reshape(-1, output[2].shape[-1]))
            if position == len(self.routers) - 1 and self.seen[0][0].shape[0] <= self.max_tokens:
                self._tally()
        return hook

    @torch.no_grad()
    def _tally(self) -> None:
        for position in range(1, len(self.routers)):
            before, _ = self.seen[position - 1]
            picks = set(self.routers[position].module.forward(before)[2].flatten().tolist())
            needed = set(self.seen[position][1].flatten().tolist())
            previous = set(self.seen[position - 1][1].flatten().tolist())
            self.needed[position] += len(needed)
            self.hit[position] += len(needed & picks)
            self.picked[position] += len(picks)
            self.naive_hit[position] += len(needed & previous)


def reads(passes: list[set[int]], capacity: int, policy: str) -> int:
    """Experts read by one layer over `passes` (each the set of experts a pass needs), from cold."""
    cache: OrderedDict[int, None] = OrderedDict()  # resident experts, least recently used first
    uses: dict[int, int] = {}
    count = 0
    for step, needed in enumerate(passes):
        for expert in needed:
            uses[expert] = uses.get(expert, 0) + 1
            if expert in cache:
                cache.move_to_end(expert)
                continue
            count += 1
            if len(cache) < capacity:
                cache[expert] = None
                continue
            evictable = [e for e in cache if e not in needed]
            if not evictable:
                continue  # beyond the slots: read, not kept
            if policy == "lru":
                victim = evictable[0]
            elif policy == "lfu":
                victim = min(evictable, key=lambda e: uses[e])  # ties: least recently used (min is stable)
            else:
                victim = max(evictable, key=lambda e: next((t for t in range(step + 1, len(passes))
                                                            if e in passes[t]), len(passes)))
            del cache[victim]
            cache[expert] = None
    return count


def decode(args, model, routers, hook_for, before_prompt=lambda: None, after_prompt=lambda: None) -> int:
    """Decode `args.limit` prompts of `args.prompts` (plain decoding, or EAGLE-2 trees of `args.nodes`)
    with the forward hook `hook_for(position)` on every router; returns the tokens generated."""
    target = TargetModel(model)
    prompts = read_prompts(args.prompts, load_tokenizer(None), target.vocab_size)[: args.limit]
    drafter = load_drafter("default", target) if args.nodes else None
    handles = [router.module.register_forward_hook(hook_for(i)) for i, router in enumerate(routers)]
    new_tokens = 0
    try:
        for ids in prompts:
            before_prompt()
            controller = StaticController(EAGLE2_BUDGET.with_nodes(args.nodes)) if args.nodes else None
            result = SpecDecoder(target, drafter, controller).generate(ids[None], max_new_tokens=args.max_new_tokens,
                                                                      eos_token_id=[])
            new_tokens += result.stats.new_tokens
            after_prompt()
    finally:
        for handle in handles:
            handle.remove()
    return new_tokens


def pregate(args, model, routers) -> dict:
    tally = PregateTally(routers, max_tokens=4 * (args.nodes + 1))  # a decoding pass, not the prefill
    decode(args, model, routers, tally.hook_for)
    rows = {}
    print("| MoE layer | recall | precision | recall of the previous layer's experts |")
    print("|---|---|---|---|")
    for position in range(1, len(routers)):
        n = tally.needed[position]
        row = {"recall": tally.hit[position] / n, "precision": tally.hit[position] / tally.picked[position],
               "previous_layer_recall": tally.naive_hit[position] / n}
        rows[position + 1] = {k: round(v, 3) for k, v in row.items()}
        print(f"| {position + 1} | {row['recall']:.3f} | {row['precision']:.3f} | {row['previous_layer_recall']:.3f} |")
    return {"layers": rows}


def eviction(args, model, routers) -> dict:
    passes: list[list[set[int]]] = []  # this prompt's passes: [L] sets of experts each
    current: dict[int, set[int]] = {}
    totals = {policy: [0, 0] for policy in POLICIES}  # policy -> [all reads, the prefill's]

    def hook_for(position: int):
        def hook(module, inputs, output):
            current[position] = set(output[2].flatten().tolist())
            if position == len(routers) - 1:
                passes.append([current[p] for p in range(len(routers))])
        return hook

    def replay():
        for policy in POLICIES:
            for layer in range(len(routers)):
                sequence = [p[layer] for p in passes]
                totals[policy][0] += reads(sequence, args.resident_experts, policy)
                totals[policy][1] += reads(sequence[:1], args.resident_experts, policy)

    new_tokens = decode(args, model, routers, hook_for, before_prompt=passes.clear, after_prompt=replay)
    print("| eviction | experts read / token | decoding passes alone | x LRU (decoding) |")
    print("|---|---|---|---|")
    lru = (totals["lru"][0] - totals["lru"][1]) / new_tokens
    rows = {}
    for policy in POLICIES:
        total, prefill = totals[policy]
        decoding = (total - prefill) / new_tokens
        rows[policy] = {"per_token": round(total / new_tokens, 3), "decoding_per_token": round(decoding, 3)}
        print(f"| {policy} | {total / new_tokens:.1f} | {decoding:.1f} | {decoding / lru:.2f} |")
    return {"resident_experts": args.resident_experts, "new_tokens": new_tokens, "reads": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("question", choices=("pregate", "eviction"))
    parser.add_argument("--prompts", type=Path, default=Path("configs/bench/heldout.jsonl"))
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--nodes", type=int, default=0, help="EAGLE-2 tree nodes a step (0: plain decoding)")
    parser.add_argument("--resident-experts", type=int, default=16, help="C (eviction)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default 32 (pregate), 48 (eviction)")
    args = parser.parse_args(argv)
    if args.max_new_tokens is None:
        args.max_new_tokens = 32 if args.question == "pregate" else 48
    model = load_target(None)
    routers = find_routers(model)
    report = (pregate if args.question == "pregate" else eviction)(args, model, routers)
    print(json.dumps({"question": args.question, "nodes": args.nodes, "limit": args.limit, **report}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
