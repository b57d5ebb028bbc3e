#!/usr/bin/env bash
# The shipped profile of the embedded pair, remade from scratch on this machine (about 4 minutes on
# 2 cores; run it alone, it times the target). Writes moe_spec/assets/default_profile.{json,npz}.
#
#   scripts/make_default_profile.sh [OUT_DIR]      # OUT_DIR: where the stages write (default runs/profile)
#
# 1. `moe-spec profile`: cost model, latency grid, greedy acceptance calibration, routing, token table;
# 2. `scripts/profile_sampling.py`: acceptance per sampling setting and candidate scheme;
# 3. `scripts/fit_head_routing.py`: the routing predictor over the draft head's outputs;
# 4. `scripts/profile_arm_rates.py`: each arm of moe-aware's bound measured (its bandit's prior), last
#    because the sizing arm prices with everything before it.
# Remake it whenever the embedded target or its draft head changes: every stage reads the head.
set -euo pipefail
cd "$(dirname "$0")/.."
# the stages are scripts: without this they would import whichever moe_spec the venv has installed
# (a non-editable install carries its own copy of the assets), not this checkout's
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PYTHON=${PYTHON:-.venv/bin/python}
OUT=${1:-runs/profile}
PROMPTS=configs/bench/profile.jsonl
"$PYTHON" -m moe_spec.cli.main profile --config configs/profile_default.yaml --out "$OUT/default_profile.json" --plots "$OUT/plots" \
  --no-arm-rates  # measured last (stage 4), once the sizing prices with every stage
"$PYTHON" scripts/profile_sampling.py --profile "$OUT/default_profile.json" --prompts "$PROMPTS" --settings 1.0 0.7:0.9
"$PYTHON" scripts/fit_head_routing.py --profile "$OUT/default_profile.json" --prompts "$PROMPTS" --out "$OUT/default_profile.json"
"$PYTHON" scripts/profile_arm_rates.py --profile "$OUT/default_profile.json" --prompts "$PROMPTS" \
  --settings temperature=0 temperature=1 temperature=0.7,top_p=0.9
for rows in 4 16; do
  "$PYTHON" scripts/profile_arm_rates.py --profile "$OUT/default_profile.json" --prompts "$PROMPTS" --settings temperature=0 \
    --rows $rows --max-prompts 16
done
cp "$OUT/default_profile.json" moe_spec/assets/default_profile.json
cp "$OUT/default_profile.npz" moe_spec/assets/default_profile.npz
echo "wrote moe_spec/assets/default_profile.json and .npz from $OUT"
