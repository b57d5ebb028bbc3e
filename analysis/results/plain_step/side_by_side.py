"""Side by side in one process, interleaved (order rotated per prompt and pass): SpecDecoder before
(the snapshot moe_spec_before, commit 6853634) and after (the working tree), with no drafter and with
the lookup drafter, against transformers' greedy and prompt-lookup decoding, all on one model object.
Ratios are per pass (tokens/s over the pass's prompts), median over passes."""
import argparse, json, statistics, sys, time
import torch
ap = argparse.ArgumentParser()
ap.add_argument("--prompts", default="configs/bench/foreign_heldout.jsonl")
ap.add_argument("--limit", type=int, default=None)
ap.add_argument("--max-new-tokens", type=int, default=48)
ap.add_argument("--repeats", type=int, default=3)
ap.add_argument("--methods", default="ar_before,ar_after,hf_greedy,lookup_before,lookup_after,hf_lookup")
ap.add_argument("--lookup-method", default="static:16")
ap.add_argument("--dtype", default="float32")
args = ap.parse_args()
torch.set_num_threads(1)
import moe_spec, moe_spec_before
from moe_spec.loading import load_target, load_tokenizer
from moe_spec.experiments.prompt_file import load_prompts
from moe_spec.experiments.hf_reference import REFERENCES
from moe_spec.core.target import TargetModel
from moe_spec.core.engine import SpecDecoder
from moe_spec.drafters.lookup import LookupDrafter
from moe_spec.policy.registry import build_controller
from moe_spec_before.core.target import TargetModel as TargetBefore
from moe_spec_before.core.engine import SpecDecoder as SpecBefore
from moe_spec_before.drafters.lookup import LookupDrafter as LookupBefore
from moe_spec_before.policy.registry import build_controller as build_controller_before
model = load_target(None, dtype=args.dtype); tok = load_tokenizer(None)
prompts = [p.input_ids(tok) for p in load_prompts(args.prompts, args.limit)]
after, before = TargetModel(model), TargetBefore(model)
decoders = {
    "ar_before": SpecBefore(before), "ar_after": SpecDecoder(after),
    "lookup_before": SpecBefore(before, LookupBefore(), build_controller_before(args.lookup_method, None)),
    "lookup_after": SpecDecoder(after, LookupDrafter(), build_controller(args.lookup_method, None)),
    "hf_greedy": REFERENCES["hf-greedy"].decoder(after), "hf_lookup": REFERENCES["hf-prompt-lookup"].decoder(after),
}
names = args.methods.split(",")
for name in names:  # warm-up
    decoders[name].generate(prompts[0], max_new_tokens=8)
passes = []
cpu_passes = []
outputs = {}
for rep in range(args.repeats):
    ms = {n: 0.0 for n in names}; toks = {n: 0 for n in names}; cpu = {n: 0.0 for n in names}
    for i, ids in enumerate(prompts):
        shift = (i + rep) % len(names)
        for name in names[shift:] + names[:shift]:
            t, c = time.perf_counter(), time.process_time()
            r = decoders[name].generate(ids, max_new_tokens=args.max_new_tokens)
            ms[name] += time.perf_counter() - t
            cpu[name] += time.process_time() - c
            toks[name] += r.stats.new_tokens
            outputs.setdefault(i, {})[name] = r.sequences[0].tolist()
    passes.append({n: toks[n] / ms[n] for n in names})
    cpu_passes.append({n: toks[n] / cpu[n] for n in names})
    print(rep, {n: round(v, 1) for n, v in passes[-1].items()}, file=sys.stderr, flush=True)
mismatch = {n: sum(o[n] != o[names[0]] for o in outputs.values()) for n in names}
def ratio(a, b, which=None):
    if a in names and b in names:
        return round(statistics.median(p[a] / p[b] for p in (which or passes)), 4)
result = {
    "config": vars(args), "prompts": len(prompts), "mismatches_vs_first": mismatch,
    "tokens_per_s_median": {n: round(statistics.median(p[n] for p in passes), 2) for n in names},
    "ar_before/hf_greedy": ratio("ar_before", "hf_greedy"), "ar_after/hf_greedy": ratio("ar_after", "hf_greedy"),
    "lookup_before/hf_lookup": ratio("lookup_before", "hf_lookup"), "lookup_after/hf_lookup": ratio("lookup_after", "hf_lookup"),
    "ar_after/ar_before": ratio("ar_after", "ar_before"),
    "cpu_time_ratios": {k: ratio(*k.split("/"), which=cpu_passes) for k in
                        ("ar_before/hf_greedy", "ar_after/hf_greedy", "lookup_before/hf_lookup", "lookup_after/hf_lookup", "ar_after/ar_before")},
    "per_pass": passes, "per_pass_cpu": cpu_passes,
}
print(json.dumps(result))
