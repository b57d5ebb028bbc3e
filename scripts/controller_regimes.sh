#!/usr/bin/env bash
# moe-aware (bounded by fixed budgets) against every fixed budget and its unbounded sizing, per
# regime, on the shipped prompts (configs/bench/heldout.jsonl) and the held-out ones
# (configs/bench/foreign_heldout.jsonl, never tuned on), with the defaults a user gets (no thread
# flag). Tables: analysis/results/controller_regimes/*.txt; summary: scripts/controller_table.py.
# Usage: scripts/controller_regimes.sh [REGIME...]   (default: every regime; --repeats via $REPEATS)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's moe_spec, whatever the venv has installed
PY=${PYTHON:-.venv/bin/python}
OUT=analysis/results/controller_regimes
REPEATS=${REPEATS:-1}
METHODS=${METHODS:-ar,static-best,moe-aware,moe-aware-unbounded}
# offloaded, the bound's read-pricing ablations run beside it (each with its own bandit)
OFFLOAD_ABLATIONS=moe-aware-nooverflow,moe-aware-profilefetch
mkdir -p "$OUT"
declare -A SETS=([shipped]=configs/bench/heldout.jsonl [heldout]=configs/bench/foreign_heldout.jsonl)
# batches never mix classes (`moe_spec.experiments.runner.batches`): B rows need B prompts of one
# class, which the mixed batch sets have (32 shipped, 24 held-out)
declare -A BATCH_SETS=([shipped]=configs/bench/batch.jsonl [heldout]=configs/bench/foreign_batch.jsonl)

bench() {  # name, then bench options (--limit: prompts per class, 2 unless given); $PROMPT_SETS: SETS or BATCH_SETS
  local name=$1; shift
  local -n sets=${PROMPT_SETS:-SETS}
  for set in shipped heldout; do
    "$PY" -m moe_spec.cli.main bench --limit 2 --prompts "${sets[$set]}" "$@" --methods "$METHODS${EXTRA:+,$EXTRA}" \
      --repeats "$REPEATS" --no-progress --json "$OUT/${name}_${set}.json" > "$OUT/${name}_${set}.txt" 2>&1
    tail -1 "$OUT/${name}_${set}.txt" | cut -c1-160
  done
}

profile_disk() {  # the shipped profile with this machine's fetch cost, for the offload regimes
  [ -f analysis/results/offload/profile_disk.json ] && [ analysis/results/offload/profile_disk.json -nt moe_spec/assets/default_profile.json ] && return
  "$PY" scripts/profile_fetch.py --profile moe_spec/assets/default_profile.json --prompts configs/bench/profile.jsonl \
    --max-prompts 8 --out analysis/results/offload/profile_disk.json
}

profile_eager() {  # the pair profiled with the eager experts kernel (experts cost about 3x more), for the eager regime
  local out=runs/profile_eager/profile.json
  [ -f $out ] && [ $out -nt moe_spec/assets/default_profile.json ] && return
  "$PY" -m moe_spec.cli.main profile --config configs/profile_default.yaml --experts-implementation eager --out $out --no-arm-rates
  "$PY" scripts/fit_head_routing.py --profile $out --prompts configs/bench/profile.jsonl --out $out
  "$PY" scripts/profile_arm_rates.py --profile $out --prompts configs/bench/profile.jsonl --experts-implementation eager \
    --settings temperature=0
}

run() {
  case $1 in
    greedy) bench greedy --config configs/bench_default.yaml ;;
    t1) bench t1 --config configs/bench_default.yaml --temperature 1 ;;
    eager) profile_eager; bench eager --config configs/bench_default.yaml --experts-implementation eager --profile runs/profile_eager/profile.json ;;
    batch4) PROMPT_SETS=BATCH_SETS bench batch4 --config configs/bench_default.yaml --batch-size 4 --limit 16 ;;  # 4 batches of 4
    batch16) PROMPT_SETS=BATCH_SETS bench batch16 --config configs/bench_default.yaml --batch-size 16 --limit 16 ;;  # one of 16
    threads1) bench threads1 --config configs/bench_default.yaml --threads 1 ;;
    offload16) profile_disk; EXTRA=$OFFLOAD_ABLATIONS bench offload16 --config configs/bench_offload.yaml ;;
    offload16_t1) profile_disk; EXTRA=$OFFLOAD_ABLATIONS bench offload16_t1 --config configs/bench_offload.yaml --temperature 1 ;;
    offload16_prefetch) profile_disk; EXTRA=$OFFLOAD_ABLATIONS bench offload16_prefetch --config configs/bench_offload.yaml --prefetch ;;
    offload8) profile_disk; EXTRA=$OFFLOAD_ABLATIONS bench offload8 --config configs/bench_offload.yaml --resident-experts 8 ;;
    offload32) profile_disk; EXTRA=$OFFLOAD_ABLATIONS bench offload32 --config configs/bench_offload.yaml --resident-experts 32 ;;
    *) echo "unknown regime $1" >&2; exit 2 ;;
  esac
}

for regime in "${@:-offload16 offload16_t1 greedy t1 batch4 offload8 offload32 offload16_prefetch}"; do
  for one in $regime; do run "$one"; done
done
