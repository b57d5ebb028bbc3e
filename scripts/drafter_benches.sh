#!/usr/bin/env bash
# The drafter table of docs/drafters.md: every drafter of the embedded target profiled on
# configs/bench/profile.jsonl, then benched greedy and at T = 1 on the shipped and the held-out
# prompt sets (2 prompts per class, 48 tokens). Run it alone: it times the target.
#
#   scripts/drafter_benches.sh [DRAFTER ...]     # default: mtp moe_spec/assets/default_draft_model lookup default
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
OUT=analysis/results/drafters
mkdir -p "$OUT" runs/profiles
for drafter in "${@:-mtp moe_spec/assets/default_draft_model lookup default}"; do
  for d in $drafter; do
    case "$d" in
      default) key=eagle3; profile=moe_spec/assets/default_profile.json ;;
      */default_draft_model) key=draft_model; profile=runs/profiles/$key.json ;;
      *) key=$d; profile=runs/profiles/$key.json ;;
    esac
    if [ ! -f "$profile" ]; then
      "$PYTHON" -m moe_spec.cli.main profile --config configs/profile_default.yaml --drafter "$d" --out "$profile" --plots runs/profiles/plots_$key
      "$PYTHON" scripts/profile_sampling.py --profile "$profile" --drafter "$d" --prompts configs/bench/profile.jsonl --settings 1.0
    fi
    for set in shipped foreign; do
      prompts=configs/bench/heldout.jsonl; [ "$set" = foreign ] && prompts=configs/bench/foreign_heldout.jsonl
      "$PYTHON" -m moe_spec.cli.main bench --drafter "$d" --profile "$profile" --prompts "$prompts" --limit 2 --max-new-tokens 48 --threads 1 \
        --methods ar,eagle2,static-best,moe-aware --json "$OUT/${key}_greedy_$set.json"
      "$PYTHON" -m moe_spec.cli.main bench --drafter "$d" --profile "$profile" --prompts "$prompts" --limit 2 --max-new-tokens 48 --threads 1 \
        --temperature 1.0 --methods ar,eagle2@sampled,static-best@sampled,moe-aware --json "$OUT/${key}_t1_$set.json"
    done
  done
done
"$PYTHON" scripts/drafter_table.py --results "$OUT"
