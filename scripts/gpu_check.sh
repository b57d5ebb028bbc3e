#!/usr/bin/env bash
# scripts/gpu_check.sh OUT_DIR [--tiny]
#
# The GPU checks of moe_spec in one call that ends well inside 8 minutes on one H200: each step
# runs under its own time limit (the limits add up to 8 minutes), a failed step is recorded and
# the next one runs.
#   1. tests             the CUDA-marked tests (tests/gpu): greedy identity with transformers and the
#                        sampling distribution, three architectures, on CUDA (MOE_SPEC_REQUIRE_CUDA=1:
#                        a missing CUDA fails them instead of skipping them)
#   2. real_shape        `moe-spec make-random --shape olmoe-1b-7b` (random weights of OLMoE-1B-7B's
#                        shapes: 16 layers, 64 experts, top-8, hidden 2048, expert intermediate 1024;
#                        bf16, made on the GPU) and `moe-spec profile` of it with the lookup drafter,
#                        its latency grid under forced routing: the cost model's coefficients, its
#                        held-out error and the unique-experts curve (profile_olmoe.json)
#   3. embedded_profile  `moe-spec profile` of the embedded pair on the GPU (profile_embedded.json): the
#                        GPU cost model that steps 4 and 5 use
#   4. embedded_bench    `moe-spec bench` of the embedded pair on the GPU, greedy: ar, eagle2,
#                        static-best, truncate, moe-aware (bench_gpu.json)
#   5. simulate          `moe-spec simulate` of the CPU bench's recorded steps (the shipped trace
#                        analysis/results/trace_cpu_greedy.jsonl, recorded on the 2-core CPU machine)
#                        under step 3's GPU cost model (simulate_gpu.json), labelled SIMULATION
# OUT_DIR gets <step>.log per step, the files named above, env.json and summary.json; the last line
# on stdout is the summary as one JSON line. Scratch (the 14 GB random model, wheels) goes under
# $MOE_SPEC_WORK (default: a fresh temporary folder), never under OUT_DIR.
#
# --tiny: the same steps on the CPU with tiny shapes and few tokens, so that the device run cannot
# fail on a typo (tests/scripts/test_gpu_check.py runs it).
#
# On the device: python3 there has torch with CUDA but an older transformers than the 5.23 moe_spec
# needs. Carry a folder of wheels (transformers 5.23 and whatever it needs that the image lacks, see
# /work/.library/device/README.md) and name it in MOE_SPEC_WHEELS: they are installed into
# $MOE_SPEC_WORK/site for this run only. The tool brings back at most 8 files from $OUT, so archive:
#   MOE_SPEC_WHEELS=.whl scripts/gpu_check.sh /tmp/gpu_check; tar -czf $OUT/gpu_check.tar.gz -C /tmp gpu_check
# PYTHON picks the interpreter (default: .venv/bin/python where it exists, else python3);
# MOE_SPEC_EXPERTS the experts implementation of steps 2-4 (default grouped_mm; megablocks where installed).

set -u -o pipefail

if [[ $# -lt 1 || $1 == -* ]]; then
  echo "usage: $0 OUT_DIR [--tiny]" >&2
  exit 2
fi
OUT=$(mkdir -p "$1" && cd "$1" && pwd)
TINY=0
[[ ${2:-} == --tiny ]] && TINY=1
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WORK=${MOE_SPEC_WORK:-$(mktemp -d)}
mkdir -p "$WORK"
if [[ -z ${PYTHON:-} ]]; then
  if [[ -x $REPO/.venv/bin/python ]]; then PYTHON=$REPO/.venv/bin/python; else PYTHON=python3; fi
fi
# the checkout itself, uninstalled (the device has no virtual environment)
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
if [[ -n ${MOE_SPEC_WHEELS:-} ]]; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" \
    "$MOE_SPEC_WHEELS"/*.whl >&2 || { echo "installing the wheels of $MOE_SPEC_WHEELS failed" >&2; exit 2; }
  export PYTHONPATH="$WORK/site:$PYTHONPATH"
fi
export PYTHONUNBUFFERED=1 MOE_SPEC_CACHE="$WORK/cache"  # no profile cache outside this run
export EXPERTS=${MOE_SPEC_EXPERTS:-grouped_mm}
export OUT TINY REPO WORK PYTHON
rm -f "$OUT/steps.jsonl"

if [[ $TINY == 1 ]]; then
  export DEVICE=cpu SHAPE=tiny-olmoe
  # tiny: a handful of tokens, prompts and timings; grid experts fit top-2 of 8 (random) and top-4 of 64 (embedded)
  export QUICK_PROFILE="--max-prompts 2 --max-new-tokens 8 --natural-trees 4 --grid-tokens 1,4 --batch-sizes 2 \
--repeats 1 --warmup 0 --evict-mb 0 --prefix-len 16"
  export RANDOM_GRID="--grid-experts 2,4" EMBEDDED_GRID="--grid-experts 4,8"
  export BENCH_SIZE="--prompts configs/bench/smoke.jsonl --limit 1 --max-new-tokens 8 --warmup-tokens 0"
  export MOE_SPEC_TEST_THREADS=1
else
  export DEVICE=cuda SHAPE=olmoe-1b-7b MOE_SPEC_REQUIRE_CUDA=1
  export QUICK_PROFILE="--max-prompts 8 --max-new-tokens 32 --natural-trees 24 --batch-sizes 2,4"
  export RANDOM_GRID="--grid-experts 8,16,24,32,48,64" EMBEDDED_GRID=""
  export BENCH_SIZE="--prompts configs/bench/heldout.jsonl --limit 2 --max-new-tokens 48 --warmup-tokens 16"
fi

moe_spec() { "$PYTHON" -m moe_spec.cli.main "$@"; }

step_env() {
  "$PYTHON" - "$OUT/env.json" <<'PY'
import json, os, platform, subprocess, sys
import torch, transformers
env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
       "cuda": torch.cuda.is_available(), "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
git = subprocess.run(["git", "-C", os.environ["REPO"], "rev-parse", "HEAD"], capture_output=True, text=True)
env["git_commit"] = git.stdout.strip() or None
env["transformers_ok"] = tuple(int(v) for v in transformers.__version__.split(".")[:2]) >= (5, 23)
open(sys.argv[1], "w").write(json.dumps(env, indent=1) + "\n")
print(json.dumps(env))
PY
}

step_tests() {
  cd "$REPO" && "$PYTHON" -m pytest -q -p no:cacheprovider -rs -m gpu tests/gpu --junitxml="$OUT/tests.xml"
}

step_real_shape() {
  local model="$WORK/$SHAPE"
  moe_spec make-random --shape "$SHAPE" --dtype bfloat16 --device "$DEVICE" --out "$model" || return
  # prompts for a model without a tokenizer: 16 random ids repeated, so that the lookup drafter drafts
  "$PYTHON" - "$model/config.json" "$WORK/random_prompts.jsonl" <<'PY' || return
import json, random, sys
vocab = json.load(open(sys.argv[1]))["vocab_size"]
rng = random.Random(0)
with open(sys.argv[2], "w") as f:
    for _ in range(8):
        block = [rng.randrange(3, vocab) for _ in range(16)]
        f.write(json.dumps({"class": "repeat", "prompt_ids": block * 4}) + "\n")
PY
  # shellcheck disable=SC2086  # the settings are word lists
  moe_spec profile --model "$model" --drafter lookup --prompts "$WORK/random_prompts.jsonl" \
    --out "$OUT/profile_olmoe.json" --dtype bfloat16 --device "$DEVICE" --experts-implementation "$EXPERTS" \
    $QUICK_PROFILE $RANDOM_GRID
}

step_embedded_profile() {
  cd "$REPO" || return
  # shellcheck disable=SC2086
  moe_spec profile --prompts configs/bench/profile.jsonl --out "$OUT/profile_embedded.json" --device "$DEVICE" \
    --experts-implementation "$EXPERTS" $QUICK_PROFILE $EMBEDDED_GRID
}

needs_embedded_profile() {
  [[ -f $OUT/profile_embedded.json ]] || { echo "needs step embedded_profile's profile_embedded.json" >&2; return 3; }
}

step_embedded_bench() {
  cd "$REPO" && needs_embedded_profile || return
  # shellcheck disable=SC2086
  moe_spec bench --device "$DEVICE" --experts-implementation "$EXPERTS" --temperature 0 \
    --methods ar,eagle2,static-best,truncate,moe-aware \
    --profile "$OUT/profile_embedded.json" --repeats 1 --no-progress --json "$OUT/bench_gpu.json" $BENCH_SIZE
}

step_simulate() {
  cd "$REPO" && needs_embedded_profile || return
  moe_spec simulate --trace analysis/results/trace_cpu_greedy.jsonl --profile "$OUT/profile_embedded.json" \
    --cost-model profile --json "$OUT/simulate_gpu.json"
}

export -f moe_spec step_env step_tests step_real_shape step_embedded_profile needs_embedded_profile \
  step_embedded_bench step_simulate

run_step() {  # run_step NAME LIMIT_S: step_NAME under `timeout`, its output in OUT/NAME.log
  local name=$1 limit=$2 start rc
  start=$(date +%s%N)
  echo "== $name (at most ${limit}s)" >&2
  timeout --kill-after=5 "$limit" bash -c "step_$name" >"$OUT/$name.log" 2>&1
  rc=$?
  local ms=$(( ($(date +%s%N) - start) / 1000000 ))
  printf '{"step": "%s", "rc": %d, "limit_s": %d, "seconds": %d.%03d, "log": "%s.log"}\n' "$name" "$rc" "$limit" \
    $(( ms / 1000 )) $(( ms % 1000 )) "$name" >>"$OUT/steps.jsonl"
  echo "== $name: exit $rc" >&2
}

START=$(date +%s)
# the limits add up to 480 s
run_step env 15
run_step tests 130
run_step real_shape 160
run_step embedded_profile 70
run_step embedded_bench 90
run_step simulate 15

"$PYTHON" - "$OUT" "$TINY" "$(( $(date +%s) - START ))" <<'PY'
import json, sys
from pathlib import Path

out, tiny, seconds = Path(sys.argv[1]), sys.argv[2] == "1", int(sys.argv[3])
steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
for step in steps:
    step["ok"] = step["rc"] == 0
    step["timed_out"] = step["rc"] in (124, 137)
    lines = (out / step["log"]).read_text(errors="replace").splitlines()
    results = [line for line in lines if line.startswith("{")]
    try:  # the JSON line each moe-spec command ends with; pytest's verdict for the tests
        step["result"] = json.loads(results[-1]) if results else (lines[-1] if lines else None)
    except json.JSONDecodeError:
        step["result"] = results[-1]
summary = {"gpu_check": True, "tiny": tiny, "ok": all(s["ok"] for s in steps), "seconds": seconds,
           "failed": [s["step"] for s in steps if not s["ok"]], "out": str(out), "steps": steps}
(out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
print(json.dumps({k: summary[k] for k in ("gpu_check", "tiny", "ok", "seconds", "failed", "out")}
                 | {"steps": {s["step"]: {"rc": s["rc"], "seconds": s["seconds"]} for s in steps}}))
sys.exit(0 if summary["ok"] else 1)
PY
