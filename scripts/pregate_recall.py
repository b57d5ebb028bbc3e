"""How well a MoE layer's router, applied to the previous MoE layer's hidden states, picks the experts
that layer then routes to (what `OffloadConfig(layer_ahead=True)` reads ahead), per layer, on
the decoding steps of the embedded pair (every expert resident).

    python scripts/pregate_recall.py --nodes 0      # plain decoding: one token a pass
    python scripts/pregate_recall.py --nodes 4      # EAGLE-2 trees of 4 nodes

Per MoE layer after the first, over the passes of decoding (the prefill left out): recall (the
share of the distinct experts the layer needed that the previous layer's hidden states picked),
precision (the share of the picks it needed), and the same recall for "the experts the previous
layer used" as the naive guess. Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from moe_spec.cli.profile import read_prompts
from moe_spec.core.drafting import EAGLE2_BUDGET
from moe_spec.core.engine import SpecDecoder
from moe_spec.core.routing import find_routers
from moe_spec.core.target import TargetModel
from moe_spec.loading import load_drafter, load_target, load_tokenizer
from moe_spec.policy.static import StaticController


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=Path, default=Path("configs/bench/heldout.jsonl"))
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--nodes", type=int, default=0, help="EAGLE-2 tree nodes a step (0: plain decoding)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    model = load_target(None)
    target = TargetModel(model)
    prompts = read_prompts(args.prompts, load_tokenizer(None), target.vocab_size)[: args.limit]
    drafter = load_drafter("default", target) if args.nodes else None
    routers = find_routers(model)
    tally = PregateTally(routers, max_tokens=4 * (args.nodes + 1))  # a decoding pass, not the prefill
    handles = [router.module.register_forward_hook(tally.hook_for(i)) for i, router in enumerate(routers)]
    try:
        for ids in prompts:
            controller = StaticController(EAGLE2_BUDGET.with_nodes(args.nodes)) if args.nodes else None
            SpecDecoder(target, drafter, controller).generate(ids[None], max_new_tokens=args.max_new_tokens, eos_token_id=[])
    finally:
        for handle in handles:
            handle.remove()
    rows = {}
    print("| MoE layer | recall | precision | recall of the previous layer's experts |")
    print("|---|---|---|---|")
    for position in range(1, len(routers)):
        n = tally.needed[position]
        row = {"recall": tally.hit[position] / n, "precision": tally.hit[position] / tally.picked[position],
               "previous_layer_recall": tally.naive_hit[position] / n}
        rows[position + 1] = {k: round(v, 3) for k, v in row.items()}
        print(f"| {position + 1} | {row['recall']:.3f} | {row['precision']:.3f} | {row['previous_layer_recall']:.3f} |")
    print(json.dumps({"nodes": args.nodes, "prompts": len(prompts), "layers": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
