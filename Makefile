PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: setup vllm-env test test-quick demo clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# the CPU build first, so no dependency pulls a CUDA build
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

# vLLM's CPU build, in its own venv (it pins another transformers); the vLLM tests run it
$(VLLM_STAMP): scripts/make_vllm_env.sh
	PYTHON=$(PY) scripts/make_vllm_env.sh $(VLLM_VENV)
	touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

test: $(STAMP) $(VLLM_STAMP)
	OMP_NUM_THREADS=2 $(BIN)/python -m pytest -q

# the quick loop: everything but the tests that train, profile or execute notebooks
test-quick: $(STAMP)
	OMP_NUM_THREADS=2 $(BIN)/python -m pytest -q -m "not slow and not gpu"

demo: $(STAMP)
	$(BIN)/moe-spec demo

clean:
	rm -rf $(VENV) $(VLLM_VENV)
