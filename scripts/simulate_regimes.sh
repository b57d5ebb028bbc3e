#!/usr/bin/env bash
# The replayed decomposition (`moe-spec simulate`, a SIMULATION, not a measurement) of every regime a
# one-row trace can replay: EAGLE-2's greedy and T = 1 steps on the shipped prompts
# (configs/bench/heldout.jsonl, 8 per class) and the held-out ones (configs/bench/foreign_heldout.jsonl,
# 6 per class), replayed with every expert resident (the shipped profile) and offloaded behind 8, 16
# and 32 resident experts per layer (the disk profile's fetch cost, analysis/results/offload/profile_disk.json).
# Traces go to runs/traces/ (recorded alone: they time drafting, which every replayed policy is
# charged); reports to analysis/results/controller_regimes/simulate_*.{txt,json}; summary:
# `python scripts/simulate_table.py`. About 8 minutes on 2 cores.
# Usage: scripts/simulate_regimes.sh [--no-trace]   (--no-trace: replay the traces already recorded)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's moe_spec, whatever the venv has installed
PY=${PYTHON:-.venv/bin/python}
OUT=analysis/results/controller_regimes
DISK=analysis/results/offload/profile_disk.json
mkdir -p runs/traces "$OUT"
declare -A SETS=([shipped]="--limit 8" [heldout]="--limit 6 --prompts configs/bench/foreign_heldout.jsonl")
if [ "${1:-}" != "--no-trace" ]; then
  for t in 0 1; do
    for set in shipped heldout; do
      # shellcheck disable=SC2086
      "$PY" -m moe_spec.cli.main bench --config configs/bench_default.yaml --temperature $t ${SETS[$set]} --methods ar \
        --no-progress --trace "runs/traces/t${t}_$set.jsonl" > "runs/traces/t${t}_$set.log" 2>&1
    done
  done
fi
simulate() {  # name, trace (t0 or t1), then simulate options
  local name=$1 trace=$2; shift 2
  for set in shipped heldout; do
    "$PY" -m moe_spec.cli.main simulate --trace "runs/traces/${trace}_$set.jsonl" --methods ar,static-best,moe-aware \
      --json "$OUT/simulate_${name}_$set.json" "$@" > "$OUT/simulate_${name}_$set.txt"
  done
}
simulate greedy t0
simulate t1 t1
for c in 8 16 32; do simulate "offload$c" t0 --profile "$DISK" --resident-experts $c; done
simulate offload16_t1 t1 --profile "$DISK" --resident-experts 16
