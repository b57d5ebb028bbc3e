#!/usr/bin/env bash
# scripts/gpu_check.sh OUT_DIR [--tiny]
#
# The GPU checks of moe_spec in one call that ends inside 8 minutes on one H200: each step runs
# under its own time limit (the limits add up to 480 s), a failed step is recorded and the next one
# runs; every step writes its results into OUT_DIR as it ends. Nothing it needs is too large to
# travel: the models are made on the device with random weights (the verify cost depends on the
# shapes, and the profiler times its grid under forced routing), never the embedded target's weights.
#   1. env          versions, the device, and the transformers 5.23 that moe_spec needs (env.json)
#   2. tests        the CUDA-marked tests (tests/gpu, the device paths of tests/core/test_bad_input.py and
#                   tests/cli/test_model_options.py, where --device and --dtype auto pick CUDA):
#                   greedy identity with transformers for the lookup and EAGLE drafters, the sampling
#                   distribution through EAGLE trees, offloaded experts (host and disk tiers) equal to
#                   the resident model, three architectures (MOE_SPEC_REQUIRE_CUDA=1: a missing CUDA
#                   fails them instead of skipping them)
#   3. olmoe        `moe-spec make-random --shape olmoe-1b-7b` (OLMoE-1B-7B's shapes: 16 layers, 64
#                   experts, top-8, hidden 2048, expert width 1024; bf16, made on the GPU) and `moe-spec
#                   profile` of it with the lookup drafter: the latency grid under forced routing, the
#                   cost model's coefficients, its held-out error, the unique-experts curve
#                   (profile_olmoe.json)
#   4. embedded     `moe-spec profile` of a random model of the embedded target's own config in bf16
#                   (`make-random --shape embedded`): the embedded target's cost model on this device
#                   (profile_embedded.json), which step 5 replays the CPU trace under
#   5. simulate     `moe-spec simulate` of the CPU bench's recorded steps (the shipped trace
#                   analysis/results/trace_cpu_greedy.jsonl, recorded on the 2-core CPU machine) under
#                   step 4's cost model (simulate_gpu.json), labelled SIMULATION
#   6. qwen3        as step 3 for Qwen3-30B-A3B's layers, 8 of its 48 (`make-random --layers 8`: 128
#                   experts, top-8, expert width 768; profile_qwen3.json)
#   7. offload      4 of OLMoE-1B-7B's layers profiled with their experts offloaded to pinned host memory
#                   and 16 resident per layer (`--offload host`): the fetch cost of a miss over the host
#                   link and the cost model with that term (profile_olmoe_offload.json)
# OUT_DIR gets <step>.log per step, the files named above, env.json and summary.json; the last line
# on stdout is the summary as one JSON line. Scratch (the random models, the expert store, wheels)
# goes under $MOE_SPEC_WORK (default: a fresh temporary folder), never under OUT_DIR.
#
# --tiny: the same steps on the CPU with tiny shapes and few tokens, so that the device run cannot
# fail on a typo (tests/scripts/test_gpu_check.py runs it; the host tier needs CUDA, so its tiny
# stand-in offloads to disk).
#
# On the device: python3 there has torch with CUDA but an older transformers than the 5.23 moe_spec
# needs. Carry a folder of wheels (transformers 5.23; the image has everything else it needs, see
# docs/gpu.md) and name it in MOE_SPEC_WHEELS: they are installed into $MOE_SPEC_WORK/site for this
# run only. The tool brings back at most 8 files from $OUT, so archive:
#   MOE_SPEC_WHEELS=.whl scripts/gpu_check.sh /tmp/gpu_check; tar -czf $OUT/gpu_check.tar.gz -C /tmp gpu_check
# GPU_CHECK_STEPS="env olmoe ..." runs only the steps named (a second call after a failed step);
# PYTHON picks the interpreter (default: .venv/bin/python where it exists, else python3);
# MOE_SPEC_EXPERTS the experts implementation of steps 3-7 (default grouped_mm; megablocks where installed).

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
  export DEVICE=cpu OLMOE=tiny-olmoe QWEN3=tiny-olmoe QWEN3_LAYERS=2 OFFLOAD_LAYERS=1 DTYPE=float32 OFFLOAD_TIER=disk
  # tiny: a handful of tokens, prompts and timings; grid experts fit top-2 of 8 (tiny) and top-4 of 64 (embedded)
  export QUICK_PROFILE="--max-prompts 2 --max-new-tokens 8 --natural-trees 4 --grid-tokens 1,4 --batch-sizes 2 \
--repeats 1 --warmup 0 --evict-mb 0 --prefix-len 16"
  export OLMOE_GRID="--grid-experts 2,4" QWEN3_GRID="--grid-experts 2,4" EMBEDDED_GRID="--grid-experts 4,8"
  export OFFLOAD_PROFILE="$QUICK_PROFILE --grid-experts 2,4"
  export MOE_SPEC_TEST_THREADS=1
else
  export DEVICE=cuda OLMOE=olmoe-1b-7b QWEN3=qwen3-30b-a3b QWEN3_LAYERS=8 OFFLOAD_LAYERS=4 DTYPE=bfloat16 OFFLOAD_TIER=host
  export MOE_SPEC_REQUIRE_CUDA=1
  export QUICK_PROFILE="--max-prompts 8 --max-new-tokens 32 --natural-trees 24 --batch-sizes 2,4"
  export OLMOE_GRID="--grid-experts 8,16,24,32,48,64" QWEN3_GRID="--grid-experts 8,16,32,64,96,128"
  export EMBEDDED_GRID="--grid-experts 4,8,16,32,48,64"
  # the compute terms only need to be there; the fetch term is what this step measures
  export OFFLOAD_PROFILE="--max-prompts 4 --max-new-tokens 16 --natural-trees 4 --batch-sizes 2 --repeats 2 \
--grid-tokens 1,8,32 --grid-experts 8,32,64"
fi

moe_spec() { "$PYTHON" -m moe_spec.cli.main "$@"; }

step_env() {
  "$PYTHON" - "$OUT/env.json" <<'PY'
import json, os, platform, subprocess, sys
import torch, transformers
env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
       "cuda": torch.cuda.is_available(), "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
       "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if torch.cuda.is_available() else None}
git = subprocess.run(["git", "-C", os.environ["REPO"], "rev-parse", "HEAD"], capture_output=True, text=True)
env["git_commit"] = git.stdout.strip() or None
env["transformers_ok"] = tuple(int(v) for v in transformers.__version__.split(".")[:2]) >= (5, 23)
import moe_spec  # noqa: F401  the checkout imports under this interpreter
open(sys.argv[1], "w").write(json.dumps(env, indent=1) + "\n")
print(json.dumps(env))
sys.exit(0 if env["transformers_ok"] else 1)
PY
}

step_tests() {
  local workers=()  # the device has 16 cores and pytest-xdist: the tests share the GPU in 6 processes
  [[ $TINY == 0 ]] && "$PYTHON" -c "import xdist" 2>/dev/null && workers=(-n 6)
  cd "$REPO" && "$PYTHON" -m pytest -q -p no:cacheprovider -rs "${workers[@]}" -m gpu tests/gpu \
    tests/core/test_bad_input.py tests/cli/test_model_options.py --junitxml="$OUT/tests.xml"
}

random_prompts() {  # random_prompts MODEL_DIR FILE: 8 prompts of 16 random ids repeated, so that the lookup drafter drafts
  "$PYTHON" - "$1/config.json" "$2" <<'PY'
import json, random, sys
vocab = json.load(open(sys.argv[1]))["vocab_size"]
rng = random.Random(0)
with open(sys.argv[2], "w") as f:
    for _ in range(8):
        block = [rng.randrange(3, vocab) for _ in range(16)]
        f.write(json.dumps({"class": "repeat", "prompt_ids": block * 4}) + "\n")
PY
}

make_random() {  # make_random SHAPE LAYERS NAME: a random model of SHAPE (LAYERS: all, or the first N) in WORK/NAME
  local model="$WORK/$3" layers=()
  [[ $2 == all ]] || layers=(--layers "$2")
  moe_spec make-random --shape "$1" "${layers[@]}" --dtype "$DTYPE" --device "$DEVICE" --out "$model" || return
  random_prompts "$model" "$WORK/prompts_$3.jsonl"
}

profile_random() {  # profile_random NAME OPTION...: profile WORK/NAME into OUT/profile_NAME.json
  local name=$1
  shift
  moe_spec profile --model "$WORK/$name" --drafter lookup --prompts "$WORK/prompts_$name.jsonl" \
    --out "$OUT/profile_$name.json" --dtype "$DTYPE" --device "$DEVICE" --experts-implementation "$EXPERTS" "$@"
}

# shellcheck disable=SC2086  # the settings are word lists
step_olmoe() { make_random "$OLMOE" all olmoe && profile_random olmoe $QUICK_PROFILE $OLMOE_GRID; }
# shellcheck disable=SC2086
step_embedded() { make_random embedded all embedded && profile_random embedded $QUICK_PROFILE $EMBEDDED_GRID; }
# shellcheck disable=SC2086
step_qwen3() { make_random "$QWEN3" "$QWEN3_LAYERS" qwen3 && profile_random qwen3 $QUICK_PROFILE $QWEN3_GRID; }

step_simulate() {
  cd "$REPO" || return
  [[ -f $OUT/profile_embedded.json ]] || { echo "needs step embedded's profile_embedded.json" >&2; return 3; }
  moe_spec simulate --trace analysis/results/trace_cpu_greedy.jsonl --cost-model "$OUT/profile_embedded.json" \
    --json "$OUT/simulate_gpu.json"
}

step_offload() {  # OLMoE's layers (4 of them: a 3.2 GB expert store rather than 13 GB, the same cost per expert)
  make_random "$OLMOE" "$OFFLOAD_LAYERS" olmoe_offload || return
  # shellcheck disable=SC2086
  profile_random olmoe_offload --offload "$OFFLOAD_TIER" --resident-experts 16 --offload-dir "$WORK/olmoe_offload.store" \
    $OFFLOAD_PROFILE
}

export -f moe_spec step_env step_tests random_prompts make_random profile_random step_olmoe step_embedded step_qwen3 \
  step_simulate step_offload

run_step() {  # run_step NAME LIMIT_S: step_NAME under `timeout`, its output in OUT/NAME.log
  local name=$1 limit=$2 start rc
  [[ " ${GPU_CHECK_STEPS:-$name} " == *" $name "* ]] || return 0
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
# the limits add up to 480 s, each 1.2-1.5x what the step took on an H200 (docs/gpu.md): 371 s in all
run_step env 20
run_step tests 140
run_step olmoe 110
run_step embedded 50
run_step simulate 15
run_step qwen3 80
run_step offload 65

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
