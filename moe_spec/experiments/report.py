"""Aggregating benchmark runs into per-method figures, and printing them.

Figures are totals over the prompts, not means of per-prompt ratios:

- `tokens_per_s`: new tokens / wall time, summed over prompts and repeated passes (prefill included,
  as in `GenerationStats`); `tokens_per_s_by_pass` the same per pass (`--repeats`);
- `speedup_vs_ar`: tokens_per_s / that of `ar` on the same prompts (null when `ar` did not run);
- `speedup_vs_hf_greedy`: tokens_per_s / that of `hf-greedy`, transformers' own `model.generate`
  (null when it did not run): what a user comparing with transformers sees;
- `mismatches`: at greedy, the (prompt, pass) outputs that differ from the identity reference's
  (`hf-greedy` where it ran, else `ar`): 0 for a lossless method in fp32; null when sampling;
- `mean_accept_len`: tokens produced / (steps x rows they advanced) (the bonus token included, so `ar` is 1);
- `verify_ms`, `draft_ms`: mean per step;
- `draft_share`: drafting time / decode time (prefill excluded);
- `plan_ms`, `plan_share`: the controller's planning time, mean per step and as a share of decode time;
- `plain_share`: the share of steps that verified no drafted node (the gate turned speculation off,
  or the controller chose a plain step);
- `unique_experts_per_layer`: mean over verify passes of the distinct experts per MoE layer;
- `expert_loads_per_token`: distinct experts summed over layers, per verify pass, summed over
  passes, divided by the tokens those passes produced;
- with the experts offloaded (`moe_spec.offload`; the report's `config["offload"]` says how), the
  reads of the verify passes: `misses_per_token` ((layer, expert) read from the slow tier per token
  produced), `mb_read_per_token` (MiB read per token produced), `hit_rate` (resident share of the
  (layer, expert) the passes needed; null when nothing was offloaded) and `fetch_wait_ms` (per
  step, the wait on reads that compute did not hide). Every generation starts from a cold cache
  (see `runner.py`) and the prefill's reads are not counted. 0 / null when nothing is offloaded.

With `static-best` asked for, every table also gets `static-best` (the best fixed budget in
hindsight, with its `budget`) and `static-tuned` (each batch decoded by the budget best on the other
batches, with `budgets`: how many batches chose each; see `static_tuned_runs`).

The per-step figures (accepted length, verify / draft / plan times, experts, tree size, steps) are
null for a method without step statistics: transformers' reference loops (`hf_reference.py`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from moe_spec.experiments.runner import Run
from moe_spec.core.stats import GenerationStats

METRICS = (
    "tokens_per_s", "speedup_vs_ar", "speedup_vs_hf_greedy", "mismatches", "mean_accept_len", "verify_ms", "draft_ms", "draft_share", "plan_ms", "plan_share",
    "plain_share", "unique_experts_per_layer", "expert_loads_per_token", "mean_tree_size", "new_tokens", "steps", "prompts", "repeats", "tokens_per_s_by_pass",
    "misses_per_token", "mb_read_per_token", "hit_rate", "fetch_wait_ms",
)
BASELINE = "ar"
HF_BASELINE = "hf-greedy"  # transformers' own greedy / sampled `model.generate`
STATIC_TUNED = "static-tuned"  # the fixed budget chosen on the other prompts (`static_tuned_runs`)
OFFLOAD_FIGURES = ("misses_per_token", "mb_read_per_token", "hit_rate", "fetch_wait_ms")
STEP_FIGURES = ("mean_accept_len", "verify_ms", "draft_ms", "draft_share", "plan_ms", "plan_share", "plain_share",
                "unique_experts_per_layer", "expert_loads_per_token", "mean_tree_size", "steps", *OFFLOAD_FIGURES)


def aggregate(stats: Sequence[GenerationStats]) -> dict:
    """The figures of one method over several prompts (speedups and mismatches are filled in by
    `compare`); the per-step figures are None when no generation has step statistics."""
    steps = [step for generation in stats for step in generation.steps]
    new_tokens = sum(g.new_tokens for g in stats)
    total_ms = sum(g.total_ms for g in stats)
    decode_ms = sum(g.decode_ms for g in stats)
    produced = sum(s.accepted_length for s in steps)
    draft_ms = sum(s.draft_ms for s in steps)
    plan_ms = sum(s.plan_ms for s in steps)
    passes = [sum(s.unique_experts_per_layer) / len(s.unique_experts_per_layer) for s in steps if s.unique_experts_per_layer]
    loads = sum(sum(s.unique_experts_per_layer) for s in steps)
    n = len(steps)
    row_steps = sum(s.rows for s in steps)  # a batched step counts once per row it advanced
    figures = {
        "tokens_per_s": _round(1000.0 * new_tokens / total_ms if total_ms > 0 else 0.0),
        "speedup_vs_ar": None,
        "speedup_vs_hf_greedy": None,
        "mismatches": None,
        "mean_accept_len": _round(produced / row_steps if row_steps else 0.0),
        "verify_ms": _round(sum(s.verify_ms for s in steps) / n if n else 0.0),
        "draft_ms": _round(draft_ms / n if n else 0.0),
        "draft_share": _round(draft_ms / decode_ms if decode_ms > 0 else 0.0),
        "plan_ms": _round(plan_ms / n if n else 0.0),
        "plan_share": _round(plan_ms / decode_ms if decode_ms > 0 else 0.0),
        "plain_share": _round(sum(s.tree_size == 0 for s in steps) / n if n else 0.0),
        "unique_experts_per_layer": _round(sum(passes) / len(passes) if passes else 0.0),
        "expert_loads_per_token": _round(loads / produced if produced else 0.0),
        "mean_tree_size": _round(sum(s.tree_size for s in steps) / row_steps if row_steps else 0.0),
        "new_tokens": new_tokens,
        "steps": n,
        "prompts": len(stats),
        **_reads(steps, produced),
    }
    if not steps and new_tokens > 0:  # decoded without step statistics (a reference loop)
        figures.update(dict.fromkeys(STEP_FIGURES))
    return figures


def _reads(steps, produced: int) -> dict:
    """The offloaded experts' reads over `steps` (verify passes) that produced `produced` tokens."""
    hits = sum(s.expert_hits for s in steps)
    misses = sum(s.expert_misses for s in steps)
    return {
        "misses_per_token": _round(misses / produced if produced else 0.0),
        "mb_read_per_token": _round(sum(s.bytes_read for s in steps) / 2**20 / produced if produced else 0.0),
        "hit_rate": _round(hits / (hits + misses)) if hits + misses else None,
        "fetch_wait_ms": _round(sum(s.fetch_wait_ms for s in steps) / len(steps) if steps else 0.0),
    }


def compare(runs: Sequence[Run], methods: Sequence[str]) -> dict[str, dict]:
    """Method name -> figures over `runs`, with speedups over `ar` where it ran."""
    table = {m: aggregate([r.stats for r in runs if r.method == m]) for m in methods}
    for m, figures in table.items():  # prompts, not runs: a repeated pass decodes the same prompts again
        mine = [r for r in runs if r.method == m]
        figures["prompts"] = len({i for r in mine for i in r.prompt_indices})
        figures["repeats"] = len({r.repeat for r in mine})
        figures["tokens_per_s_by_pass"] = _rates_by_pass(mine)
    for key, name in (("speedup_vs_ar", BASELINE), ("speedup_vs_hf_greedy", HF_BASELINE)):
        baseline = table.get(name)
        for figures in table.values():
            if baseline is not None and baseline["tokens_per_s"] > 0:
                figures[key] = _round(figures["tokens_per_s"] / baseline["tokens_per_s"])
    reference = identity_reference(methods)
    if runs and all(r.greedy for r in runs):
        for m, figures in table.items():
            figures["mismatches"] = mismatches(runs, m, reference)
    return table


def _rates_by_pass(runs: Sequence[Run]) -> list[float]:
    """Tokens per second of each pass over the prompts, in pass order: how far one method moves
    between passes, the noise floor of every ratio in the table."""
    rates = []
    for repeat in sorted({r.repeat for r in runs}):
        mine = [r.stats for r in runs if r.repeat == repeat]
        total_ms = sum(g.total_ms for g in mine)
        rates.append(_round(1000.0 * sum(g.new_tokens for g in mine) / total_ms) if total_ms > 0 else 0.0)
    return rates


def identity_reference(methods: Sequence[str]) -> str:
    """The method whose greedy output every other one must equal: transformers' own where it ran."""
    return HF_BASELINE if HF_BASELINE in methods else BASELINE


def mismatches(runs: Sequence[Run], method: str, reference: str) -> int | None:
    """(prompt, pass) outputs of `method` that differ from `reference`'s on the same prompt and pass
    (None when `reference` did not run)."""
    expected = {(i, r.repeat): r.new_ids_of(i) for r in runs if r.method == reference for i in r.prompt_indices}
    if not expected:
        return None
    return sum(r.new_ids_of(i) != expected[(i, r.repeat)]
               for r in runs if r.method == method for i in r.prompt_indices if (i, r.repeat) in expected)


def add_static_best(table: dict[str, dict]) -> None:
    """Add `static-best`: the figures of the fixed budget (`static:N`, of either candidate scheme when
    both ran) with the best throughput here."""
    static = {name: figures for name, figures in table.items() if name.startswith("static:")}
    if static:
        best = max(static, key=lambda name: static[name]["tokens_per_s"])
        table["static-best"] = {**static[best], "budget": best}


def static_tuned_runs(runs: Sequence[Run]) -> tuple[list[Run], dict[str, int]]:
    """`static-tuned`: for each batch of prompts, the runs (every pass) of the fixed budget of best
    throughput on the *other* batches, renamed; and how many batches chose each budget. ([], {})
    with fewer than two batches or no fixed budget.

    `static-best` picks, after the fact, the best of about ten noisy measurements on the very runs
    it is then credited with, so it carries the luck of its pick: two near-identical shapes here
    differ by up to 10% in one run, and the maximum of ten such figures sits several percent above
    any budget's expected rate. A budget chosen on other prompts has no luck of its own on these
    (its runs here played no part in choosing it): it is what tuning a fixed tree offline buys."""
    static = sorted({r.method for r in runs if r.method.startswith("static:")})
    groups = list(dict.fromkeys(r.prompt_indices for r in runs))
    if not static or len(groups) < 2:
        return [], {}
    totals = {}  # (method, batch) -> [new tokens, ms]
    for r in runs:
        if r.method in static:
            total = totals.setdefault((r.method, r.prompt_indices), [0, 0.0])
            total[0] += r.stats.new_tokens
            total[1] += r.stats.total_ms

    def rate_without(method: str, held: tuple[int, ...]) -> float:
        tokens = sum(t for (m, g), (t, _) in totals.items() if m == method and g != held)
        ms = sum(ms for (m, g), (_, ms) in totals.items() if m == method and g != held)
        return tokens / ms if ms > 0 else 0.0

    tuned, chosen = [], {}
    for group in groups:
        best = max(static, key=lambda method: rate_without(method, group))
        chosen[best] = chosen.get(best, 0) + 1
        tuned += [replace(r, method=STATIC_TUNED) for r in runs if r.method == best and r.prompt_indices == group]
    return tuned, chosen


def build_report(runs: Sequence[Run], methods: Sequence[str], classes: Sequence[str], prompt_meta: Sequence[dict],
                 config: dict, static_best: bool = False) -> dict:
    """The JSON report. `classes[i]` and `prompt_meta[i]` describe prompt i. With `static_best`, every
    table also gets the best fixed budget in hindsight (chosen per table: overall, and per class) and
    `static-tuned`, each batch decoded by the budget best on the other batches (`static_tuned_runs`;
    its `budgets` say how many batches chose each)."""
    tuned, chosen = static_tuned_runs(runs) if static_best else ([], {})
    tabled = [*methods, STATIC_TUNED] if tuned else list(methods)
    scored = [*runs, *tuned]
    per_class = {}
    for name in dict.fromkeys(classes):  # first-seen order
        per_class[name] = compare([r for r in scored if classes[r.prompt_index] == name], tabled)
        if static_best:
            add_static_best(per_class[name])
    per_prompt = []
    for index, meta in enumerate(prompt_meta):
        mine = {r.method: r for r in runs if index in r.prompt_indices and r.repeat == 0}
        per_prompt.append({
            "index": index,
            "class": classes[index],
            **meta,
            "methods": {
                m: {
                    **mine[m].stats.summary(),
                    "new_ids": list(mine[m].new_ids_of(index)),
                    "batch": list(mine[m].prompt_indices),
                    "tree_sizes": [step.tree_size for step in mine[m].stats.steps],
                    "accepted_lengths": [step.accepted_length for step in mine[m].stats.steps],
                }
                for m in methods
            },
        })
    overall = compare(scored, tabled)
    if static_best:
        add_static_best(overall)
    if tuned:
        overall[STATIC_TUNED]["budgets"] = chosen
    return {"methods": overall, "per_class": per_class, "per_prompt": per_prompt, "config": config}


COLUMNS = (  # (header, key, format)
    ("tok/s", "tokens_per_s", "{:.1f}"),
    ("speedup", "speedup_vs_ar", "{:.2f}x"),
    ("vs hf", "speedup_vs_hf_greedy", "{:.2f}x"),
    ("accept", "mean_accept_len", "{:.2f}"),
    ("tree", "mean_tree_size", "{:.1f}"),
    ("verify ms", "verify_ms", "{:.2f}"),
    ("draft ms", "draft_ms", "{:.2f}"),
    ("draft %", "draft_share", "{:.1%}"),
    ("plan %", "plan_share", "{:.1%}"),
    ("plain %", "plain_share", "{:.0%}"),
    ("experts/layer", "unique_experts_per_layer", "{:.1f}"),
    ("loads/token", "expert_loads_per_token", "{:.1f}"),
    ("mismatch", "mismatches", "{:d}"),
)
OFFLOAD_COLUMNS = (  # shown when the report's experts were offloaded
    ("miss/tok", "misses_per_token", "{:.2f}"),
    ("MB/tok", "mb_read_per_token", "{:.3f}"),
    ("hit %", "hit_rate", "{:.1%}"),
)


def format_table(figures: dict[str, dict], title: str, columns: tuple[tuple[str, str, str], ...] = COLUMNS) -> str:
    """A fixed-width table, one method per row."""
    width = max([len("method")] + [len(name) for name in figures])
    rows = [[fmt.format(row[key]) if row[key] is not None else "-" for _, key, fmt in columns] for row in figures.values()]
    widths = [max(len(header), *(len(r[i]) for r in rows)) for i, (header, _, _) in enumerate(columns)]
    lines = [title, "  ".join(["method".ljust(width)] + [h.rjust(w) for (h, _, _), w in zip(columns, widths)])]
    for name, row in zip(figures, rows):
        lines.append("  ".join([name.ljust(width)] + [cell.rjust(w) for cell, w in zip(row, widths)]))
    return "\n".join(lines)


def format_report(report: dict) -> str:
    """All methods, then each prompt class (with the offloaded experts' reads when they were)."""
    counts = {}
    for prompt in report["per_prompt"]:
        counts[prompt["class"]] = counts.get(prompt["class"], 0) + 1
    offload = report["config"].get("offload")
    columns = COLUMNS + OFFLOAD_COLUMNS if offload else COLUMNS
    parts = [format_table(report["methods"], f"all prompts ({len(report['per_prompt'])})", columns)]
    if offload:
        parts.insert(0, offload_line(offload) + "\n(every generation from a cold cache; the prefill's reads not counted)")
    if len(report["per_class"]) > 1:
        for name, figures in report["per_class"].items():
            parts.append(format_table(figures, f"class {name} ({counts[name]} prompts)", columns))
    differ = {m: f["mismatches"] for m, f in report["methods"].items() if f.get("mismatches")}
    if differ:
        reference = identity_reference(list(report["methods"]))
        parts.append(f"WARNING: greedy outputs differ from {reference}'s: "
                     + ", ".join(f"{m} on {n} prompt runs" for m, n in differ.items()))
    return "\n\n".join(parts)


def summary_line(report: dict) -> dict:
    """What the final JSON line carries: the headline figures per method."""
    keys = ("tokens_per_s", "speedup_vs_ar", "speedup_vs_hf_greedy", "mismatches", "mean_accept_len")
    offload = report["config"].get("offload")
    if offload:
        keys += ("misses_per_token", "mb_read_per_token", "hit_rate")
    line = {
        "methods": {m: {k: f[k] for k in keys} for m, f in report["methods"].items()},
        "per_class_speedup": {c: {m: f["speedup_vs_ar"] for m, f in t.items()} for c, t in report["per_class"].items()},
    }
    if HF_BASELINE in report["methods"]:
        line["per_class_speedup_vs_hf_greedy"] = {
            c: {m: f["speedup_vs_hf_greedy"] for m, f in t.items()} for c, t in report["per_class"].items()}
    if offload:
        line["offload"] = offload
    return line


def offload_line(offload: dict) -> str:
    """An offload summary (`ExpertOffload.summary()`, as a report's `config["offload"]` holds it) in words."""
    reads = "O_DIRECT reads" if offload.get("direct_reads") else "reads through the page cache"
    return (f"experts offloaded: {offload['offload']}; resident {offload['resident_mb']:.3f} MB of "
            f"{offload['experts_mb']:.3f} MB; {reads}; store {offload['store']}")


def _round(value: float) -> float:
    return round(value, 4)
