"""How often tree-verified greedy output differs from transformers' greedy `generate`, per dtype.

Verifying N drafted tokens in one forward sums the same products in another order than decoding
them one at a time, so in half precision a near-tie between the two best logits can flip and the
sequences part from there (in fp32 the rounding is far below any gap seen). This measures it:

    OMP_NUM_THREADS=1 .venv/bin/python scripts/dtype_divergence.py

- the 7 MoE architectures as tiny random models (`moe_spec.testing.tiny_models`), with the lookup
  drafter and a random EAGLE head (`random_eagle_head`), on seeded random prompts (half of them
  repetitive, so the lookup drafter drafts);
- the embedded pair (`load_target(dtype=...)`) with its EAGLE head and the lookup drafter, on
  `configs/bench/foreign_heldout.jsonl`; transformers' own prompt lookup
  (`prompt_lookup_num_tokens`) and moe_spec's autoregressive path (`ar`, one token per forward)
  are measured beside them as references;
- the cost of fp32 against bf16 for the embedded pair with its EAGLE head: tokens/s, the two
  dtypes interleaved prompt by prompt in one run.

A row "diverges" when its new tokens differ from `hf_greedy`'s at any position. Prints a table,
writes `--out` (default analysis/results/dtype_divergence.json) and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import transformers
from tqdm import tqdm

from moe_spec import LookupDrafter, SpecDecoder
from moe_spec.core.target import TargetModel
from moe_spec.drafters import EagleDrafter
from moe_spec.experiments.prompt_file import load_prompts
from moe_spec.loading import DEFAULT_DRAFTER, DTYPES, load_target, load_tokenizer
from moe_spec.testing.helpers import hf_greedy, random_eagle_head
from moe_spec.testing.tiny_models import MOE_ARCHITECTURES, TINY_CONFIGS, tiny_model

EMBEDDED = "embedded"
HF_LOOKUP_TOKENS = 10  # transformers' prompt-lookup default draft length


@dataclass
class Cell:
    """Divergence of one (dtype, architecture, drafter) over its prompts."""

    dtype: str
    architecture: str
    drafter: str  # "lookup", "eagle", "ar" (no drafter) or "hf_prompt_lookup" (transformers' own)
    prompts: int = 0
    diverged: int = 0
    first_divergence: list[int] | None = None  # new-token index where each diverged prompt first differs
    error: str | None = None  # the dtype does not run for this model on this machine

    @property
    def rate(self) -> float | None:
        return self.diverged / self.prompts if self.prompts else None

    def add(self, ours: list[int], reference: list[int]) -> None:
        self.prompts += 1
        if ours != reference:
            self.diverged += 1
            position = next((i for i, (a, b) in enumerate(zip(ours, reference)) if a != b), min(len(ours), len(reference)))
            self.first_divergence = (self.first_divergence or []) + [position]


def tiny_prompts(count: int, vocab: int, seed: int) -> list[list[int]]:
    """Seeded random prompts of ids 3..vocab-1 (specials left out): even ones a repeated 4-6-gram."""
    generator = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(count):
        if i % 2 == 0:
            gram = torch.randint(3, vocab, (int(torch.randint(4, 7, (1,), generator=generator)),), generator=generator)
            prompts.append(gram.repeat(4)[:20].tolist())
        else:
            prompts.append(torch.randint(3, vocab, (16,), generator=generator).tolist())
    return prompts


def hf_prompt_lookup(model, prompt: list[int], max_new_tokens: int) -> torch.Tensor:
    ids = torch.tensor([prompt])
    return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                          prompt_lookup_num_tokens=HF_LOOKUP_TOKENS, pad_token_id=0)


def measure_model(model, drafters: dict, prompts: list[list[int]], new: int, cells: dict, key, bar,
                  with_hf_lookup: bool, saved) -> None:
    """Adds each prompt's outcome for every drafter of `drafters` (name -> drafter or None) to `cells`."""
    target = TargetModel(model)
    for prompt in prompts:
        reference = hf_greedy(model, prompt, new)[0, len(prompt):].tolist()
        for name, drafter in drafters.items():
            result = SpecDecoder(target, drafter=drafter).generate(torch.tensor([prompt]), max_new_tokens=new)
            ours = result.sequences[0, len(prompt):len(prompt) + result.stats.new_tokens].tolist()
            cells[(*key, name)].add(ours, reference)
        if with_hf_lookup:
            cells[(*key, "hf_prompt_lookup")].add(hf_prompt_lookup(model, prompt, new)[0, len(prompt):].tolist(), reference)
        bar.update(1)
        saved()  # the file holds every prompt measured so far, should the run be cut short


def runs_on_cpu(model) -> str | None:
    """None when a two-token forward runs in the model's dtype here, else the error."""
    try:
        with torch.no_grad():
            model(torch.tensor([[3, 4]]))
    except (RuntimeError, NotImplementedError, TypeError) as error:
        return f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    return None


def fp32_cost(prompts: list[list[int]], new: int, passes: int, bar) -> dict:
    """tokens/s of the embedded pair with its EAGLE head, bf16 and fp32 interleaved prompt by prompt."""
    dtypes = ("bfloat16", "float32")
    decoders = {}
    for dtype in dtypes:
        target = TargetModel(load_target(dtype=dtype))
        decoders[dtype] = SpecDecoder(target, drafter=EagleDrafter.from_pretrained(DEFAULT_DRAFTER, target))
    for decoder in decoders.values():  # warm-up
        decoder.generate(torch.tensor([prompts[0]]), max_new_tokens=4)
    seconds = dict.fromkeys(dtypes, 0.0)
    tokens = dict.fromkeys(dtypes, 0)
    for p in range(passes):
        for i, prompt in enumerate(prompts):
            order = dtypes if (i + p) % 2 == 0 else dtypes[::-1]
            for dtype in order:
                start = time.perf_counter()
                result = decoders[dtype].generate(torch.tensor([prompt]), max_new_tokens=new)
                seconds[dtype] += time.perf_counter() - start
                tokens[dtype] += result.stats.new_tokens
            bar.update(1)
    rate = {dtype: tokens[dtype] / seconds[dtype] for dtype in dtypes}
    return {"method": "eagle (SpecDecoder, EAGLE-2 default budget)", "prompts": len(prompts), "passes": passes,
            "new_tokens": new, "tokens_per_s": {k: round(v, 2) for k, v in rate.items()},
            "fp32_over_bf16_tokens_per_s": round(rate["float32"] / rate["bfloat16"], 3),
            "torch_threads": torch.get_num_threads()}


def print_table(cells, cost) -> None:
    print(f"\n{'dtype':<9} {'architecture':<12} {'drafter':<17} {'diverged':>9}  rate")
    for cell in cells:
        shown = cell.error or (f"{cell.rate:.3f}" if cell.prompts else "-")
        print(f"{cell.dtype:<9} {cell.architecture:<12} {cell.drafter:<17} {cell.diverged:>4}/{cell.prompts:<4}  {shown}")
    if cost is not None:
        print(f"\nembedded + EAGLE, tokens/s: {cost['tokens_per_s']}; fp32 / bf16 = {cost['fp32_over_bf16_tokens_per_s']}")


def summary_line(out, cells, cost) -> dict:
    return {"out": str(out), "fp32_over_bf16_tokens_per_s": cost and cost["fp32_over_bf16_tokens_per_s"],
            "diverged": {f"{c.dtype}/{c.architecture}/{c.drafter}": (c.error and "error") or f"{c.diverged}/{c.prompts}"
                         for c in cells}}


def merge(paths: list[str], out: Path) -> dict:
    """One result file from several runs' files (e.g. one per dtype, run side by side): each cell from
    the last file that has it, the cost from the last file that measured it, every run's command kept."""
    runs, cells, cost = [], {}, None
    for path in paths:
        document = json.loads(Path(path).read_text())
        runs.append({k: v for k, v in document.items() if k not in ("cells", "fp32_cost")})
        for raw in document["cells"]:
            cell = Cell(**{k: v for k, v in raw.items() if k != "rate"})
            cells[(cell.dtype, cell.architecture, cell.drafter)] = cell
        cost = document.get("fp32_cost") or cost
    order = {d: i for i, d in enumerate(("float32", "bfloat16", "float16"))}
    ordered = sorted(cells.values(), key=lambda c: (order.get(c.dtype, 9), c.architecture == EMBEDDED))
    document = {"runs": runs, "cells": [{**asdict(c), "rate": c.rate} for c in ordered], "fp32_cost": cost}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document, indent=1) + "\n")
    print_table(ordered, cost)
    print(json.dumps(summary_line(out, ordered, cost)))
    return document


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", default="configs/bench/foreign_heldout.jsonl", help="prompts for the embedded pair")
    parser.add_argument("--limit", type=int, default=24, help="embedded prompts used (file order)")
    parser.add_argument("--tiny-prompts", type=int, default=24, help="random prompts per tiny architecture")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--dtypes", nargs="*", default=["float32", "bfloat16", "float16"], choices=sorted(DTYPES))
    parser.add_argument("--architectures", nargs="+", default=[*MOE_ARCHITECTURES, EMBEDDED])
    parser.add_argument("--cost-prompts", type=int, default=8, help="embedded prompts timed for the fp32 cost (0: skip)")
    parser.add_argument("--cost-passes", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="analysis/results/dtype_divergence.json")
    parser.add_argument("--merge", nargs="+", metavar="JSON", help="only combine these result files into --out")
    args = parser.parse_args(argv)
    if args.merge:
        return merge(args.merge, Path(args.out))
    transformers.utils.logging.disable_progress_bar()  # one bar: this script's

    tokenizer = load_tokenizer() if EMBEDDED in args.architectures else None
    embedded_prompts = ([p.input_ids(tokenizer)[0].tolist() for p in load_prompts(args.prompts)][: args.limit]
                        if tokenizer is not None else [])
    tiny_archs = [a for a in args.architectures if a != EMBEDDED]
    total = len(args.dtypes) * (len(tiny_archs) * args.tiny_prompts + len(embedded_prompts))
    total += args.cost_prompts * args.cost_passes
    cells: dict[tuple, Cell] = {}
    bar = tqdm(total=total, desc="dtype-divergence", file=sys.stderr)
    start = time.perf_counter()
    out = Path(args.out)
    cost = None

    def report(complete: bool = False) -> dict:
        document = {
            "command": "OMP_NUM_THREADS=1 .venv/bin/python scripts/dtype_divergence.py " + " ".join(argv or sys.argv[1:]),
            "complete": complete,
            "reference": "moe_spec.testing.helpers.hf_greedy (model.generate, do_sample=False)",
            "new_tokens": args.new_tokens, "embedded_prompts": args.prompts,
            "embedded_prompt_count": len(embedded_prompts), "tiny_prompts": args.tiny_prompts, "seed": args.seed,
            "cells": [{**asdict(c), "rate": c.rate} for c in cells.values()],
            "fp32_cost": cost,
            "machine": {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
                        "threads": torch.get_num_threads()},
            "minutes": round((time.perf_counter() - start) / 60, 2),
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(document, indent=1) + "\n")
        return document
    for dtype in args.dtypes:
        for arch in args.architectures:
            names = ["ar", "lookup", "eagle"] + (["hf_prompt_lookup"] if arch == EMBEDDED else [])
            for name in names:
                cells[(dtype, arch, name)] = Cell(dtype, arch, name)
            if arch == EMBEDDED:
                model, prompts = load_target(dtype=dtype), embedded_prompts
            else:
                model = tiny_model(arch, seed=args.seed, dtype=DTYPES[dtype])
                prompts = tiny_prompts(args.tiny_prompts, TINY_CONFIGS[arch]["vocab_size"], args.seed)
            bar.set_postfix_str(f"{dtype} {arch}")
            error = runs_on_cpu(model)
            if error is not None:
                for name in names:
                    cells[(dtype, arch, name)].error = error
                bar.update(len(prompts))
                continue
            target = TargetModel(model)
            head = (EagleDrafter.from_pretrained(DEFAULT_DRAFTER, target) if arch == EMBEDDED
                    else EagleDrafter(random_eagle_head(target, draft_vocab=64, seed=args.seed), target))
            drafters = {"ar": None, "lookup": LookupDrafter(), "eagle": head}
            try:
                measure_model(model, drafters, prompts, args.new_tokens, cells, (dtype, arch), bar, arch == EMBEDDED, report)
            except (RuntimeError, NotImplementedError) as error:  # a kernel missing for this dtype mid-decode
                for name in names:
                    cells[(dtype, arch, name)].error = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    if args.cost_prompts and EMBEDDED in args.architectures:
        bar.set_postfix_str("fp32 cost")
        cost = fp32_cost(embedded_prompts[: args.cost_prompts], args.new_tokens, args.cost_passes, bar)
    bar.close()

    print_table(cells.values(), cost)
    document = report(complete=True)
    summary = summary_line(out, cells.values(), cost)
    print(json.dumps(summary))
    return document


if __name__ == "__main__":
    main()
