"""What deriving and drawing from a next-token distribution costs, old way against new, side by side.

    python scripts/sampling_cost.py [--prompts configs/bench/heldout.jsonl] [--rows 256] [--repeats 5]

On the embedded target's own logits (the last `--rows` positions of each prompt's prefill, spread
over the prompt file): `probabilities` at T = 0.7 top-p 0.9 with the nucleus from the largest
logits (`nucleus_dropped`) against sorting the whole vocabulary (`nucleus_dropped_sorted`), and
`sample` (inverse CDF) against `torch.multinomial`. Each figure is the best of `--repeats` timed
sweeps over the same rows, the two ways interleaved; the masks are checked equal row by row.
Prints a line per figure and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from moe_spec.core.sampling import SamplingConfig, nucleus_dropped, nucleus_dropped_sorted, probabilities, sample
from moe_spec.experiments.prompt_file import load_prompts
from moe_spec.loading import load_target, load_tokenizer


def prompt_logits(prompts: list[str], rows: int) -> torch.Tensor:
    """[rows, V] the target's logits at the last positions of each prompt's prefill."""
    model, tokenizer = load_target(), load_tokenizer()
    per_prompt = -(-rows // len(prompts))
    parts = []
    with torch.inference_mode():
        for text in prompts:
            ids = tokenizer(text, return_tensors="pt").input_ids
            parts.append(model(ids).logits[0, -per_prompt:].float())
    return torch.cat(parts)[:rows]


def best_us(fn, rows: torch.Tensor, repeats: int) -> float:
    """Microseconds per row of `fn(row)`, the best of `repeats` sweeps."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for row in rows:
            fn(row)
        best = min(best, (time.perf_counter() - start) / len(rows) * 1e6)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default="configs/bench/heldout.jsonl")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    prompts = [prompt.text for prompt in load_prompts(args.prompts) if prompt.text is not None]
    logits = prompt_logits(prompts, args.rows)
    config = SamplingConfig(0.7, top_p=0.9)
    scaled = logits / config.temperature
    mismatched = sum(not torch.equal(nucleus_dropped(row, config.top_p), nucleus_dropped_sorted(row, config.top_p))
                     for row in scaled)

    def sorted_probabilities(row: torch.Tensor) -> torch.Tensor:
        scores = row.float() / config.temperature
        return scores.masked_fill(nucleus_dropped_sorted(scores, config.top_p), float("-inf")).softmax(-1)

    distributions = [probabilities(row, config) for row in logits]
    generator = torch.Generator().manual_seed(0)
    indices = torch.arange(len(distributions))
    ways = {  # name -> (function, what it sweeps)
        "probabilities_sorted_us": (sorted_probabilities, logits),
        "probabilities_us": (lambda row: probabilities(row, config), logits),
        "multinomial_us": (lambda i: int(torch.multinomial(distributions[int(i)], 1, generator=generator)), indices),
        "sample_us": (lambda i: sample(distributions[int(i)], generator), indices),
    }
    figures = {name: float("inf") for name in ways}
    for _ in range(2):  # the ways alternate, twice over
        for name, (fn, rows) in ways.items():
            figures[name] = min(figures[name], best_us(fn, rows, args.repeats))
    print(f"{len(logits)} rows of {logits.shape[1]} logits, T = 0.7 top-p 0.9, masks equal on every row: {mismatched == 0}")
    print(f"probabilities: {figures['probabilities_us']:.0f} us a row (nucleus from the top) against "
          f"{figures['probabilities_sorted_us']:.0f} us (whole vocabulary sorted)")
    print(f"sample: {figures['sample_us']:.0f} us a draw (inverse CDF) against {figures['multinomial_us']:.0f} us "
          f"(torch.multinomial)")
    print(json.dumps({"command": "sampling_cost", "rows": len(logits), "vocab": logits.shape[1],
                      "mismatched_masks": mismatched, **{k: round(v, 1) for k, v in figures.items()}}))
    return 0 if mismatched == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
