# Everything runs inside a local virtualenv (.venv) that the first target builds.
# torch is pinned to the 2.13.0 CPU build in the install step so pip never pulls a CUDA build here;
# on a GPU machine, install the torch you want first and `pip install -e .` keeps it.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
TORCH  ?= torch==2.13.0
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install demo test test-quick lint format bench clean

$(STAMP): pyproject.toml startup/_darts_startup.py startup/mergekit_darts_hook.pth
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev]" "$(TORCH)"
	touch $@

install: $(STAMP)

## The main job: build the tiny demo family, merge + surgery with mergekit-yaml, evaluate with lm_eval.
demo: install
	$(BIN)/python -m mergekit_darts.demo

## The test suite (pytest's "no tests collected", exit 5, counts as success).
test: install
	$(BIN)/python -m pytest -q; rc=$$?; [ $$rc -eq 5 ] && rc=0; exit $$rc

lint: install
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

format: install
	$(BIN)/ruff format . && $(BIN)/ruff check --fix .

bench: install
	$(BIN)/python -m benchmarks

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
