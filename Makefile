# One entry point for set-up, tests, demo and engines. Every target creates .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv test demo engines triton triton-env bench serve clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, by exact pin, so the resolver takes the local CPU wheel.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

# Triton server side: its own venv, because the python-backend stub bundled in nvidia-pytriton needs
# numpy < 2 (the main venv has numpy 2). It holds tritonserver + python backend, torch, onnxruntime and
# this package (editable), which the stub imports. Tests and clients use the main venv (tritonclient).
TRITON_VENV := .venv-triton
TRITON_STAMP := $(TRITON_VENV)/.installed
triton-env: $(TRITON_STAMP)

$(TRITON_STAMP): pyproject.toml
	test -x $(TRITON_VENV)/bin/python || $(PYTHON) -m venv $(TRITON_VENV)
	$(TRITON_VENV)/bin/python -m pip install -q --upgrade pip
	$(TRITON_VENV)/bin/python -m pip install -q torch==2.13.0
	$(TRITON_VENV)/bin/python -m pip install -q -e '.[triton-server]'
	touch $(TRITON_STAMP)

test: venv triton-env
	$(BIN)/python -m mypy
	$(BIN)/python -m pytest -q tests

# One generation on the demo models (models/), printed as JSON with its statistics.
demo: venv
	$(BIN)/dflash-trt generate --prompt "def fibonacci(n):" --max-new-tokens 64 --json

# Every engine this machine supports, from engines.toml (CPU: ONNX drafter + PyTorch target; GPU: TensorRT /
# TensorRT-LLM too) into engines/ with engines/manifest.json. Unchanged inputs: nothing is rebuilt.
# Other checkpoints: make engines ENGINES_ARGS="--target DIR --drafter DIR --out DIR"
ENGINES_CONFIG ?= engines.toml
engines: venv
	$(BIN)/dflash-trt engines --config $(ENGINES_CONFIG) $(ENGINES_ARGS)

# Triton demo: a model repository for the demo models, served by a real tritonserver on
# 127.0.0.1:8000 (HTTP) / 8001 (gRPC) / 8002 (metrics). Then, e.g.:
#   .venv/bin/dflash-trt triton-client --prompt "def fib(n):" --stream
# Other sources: make triton TRITON_SOURCE="--engines engines"
TRITON_SOURCE ?= --target $(DEMO_DIR)/target --drafter $(DEMO_DIR)/drafter
DEMO_DIR ?= models
TRITON_REPO ?= .cache/triton-repo
triton: venv triton-env
	$(BIN)/dflash-trt triton-repo $(TRITON_SOURCE) --out $(TRITON_REPO) --force
	$(BIN)/dflash-trt triton-serve --repo $(TRITON_REPO)

# Benchmark on the demo models: DFlash (PyTorch + ONNX Runtime drafters, block sizes 4 8 16 up to the
# trained size) vs the target alone, HF generate, HF assisted generation (models/ar-draft) and prompt
# lookup; T 0 and 1; 128 and 512 new tokens. Writes results/bench/{results.json,speedup.png,
# acceptance_hist.png,profile.json} and prints the table. A greedy mismatch fails it.
# Stops starting new prompts after 12 min (a 2-core machine must finish in 15). More or fewer runs:
# make bench BENCH_ARGS="--prompts-per-set 5 --repeats 2 --max-minutes 60" (see dflash-trt bench --help)
BENCH_OUT ?= results/bench
bench: venv
	$(BIN)/dflash-trt bench --profile --out $(BENCH_OUT)
	$(BIN)/dflash-trt bench --out $(BENCH_OUT) --max-minutes 12 $(BENCH_ARGS)

# HTTP server on 127.0.0.1:8000 (native /generate + OpenAI-compatible /v1/*), demo models by default.
# Other models / flags: make serve SERVE_ARGS="--target DIR --drafter DIR --port 8080 --api-key KEY"
serve: venv
	$(BIN)/dflash-trt serve $(SERVE_ARGS)

clean:
	rm -rf $(VENV) $(TRITON_VENV) build dist *.egg-info
