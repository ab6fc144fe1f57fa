# One entry point for set-up, tests, demo and engines. Every target creates .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv test demo engines clean
TINY := .cache/tiny

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, by exact pin, so the resolver takes the local CPU wheel.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

test: venv
	$(BIN)/python -m pytest -q tests

# Until the trained demo models exist: a tiny random pair, to show the whole path runs.
$(TINY)/drafter/config.json: | $(STAMP)
	$(BIN)/python scripts/make_tiny_models.py --out $(TINY)

demo: venv $(TINY)/drafter/config.json
	$(BIN)/dflash-trt generate --target $(TINY)/target --drafter $(TINY)/drafter --input-ids 1,2,3,4 --max-new-tokens 32 --json

# Every engine this machine supports, from engines.toml (CPU: ONNX drafter + PyTorch target; GPU: TensorRT /
# TensorRT-LLM too) into engines/ with engines/manifest.json. Unchanged inputs: nothing is rebuilt.
# Other checkpoints: make engines ENGINES_ARGS="--target DIR --drafter DIR --out DIR"
ENGINES_CONFIG ?= engines.toml
engines: venv
	$(BIN)/dflash-trt engines --config $(ENGINES_CONFIG) $(ENGINES_ARGS)

clean:
	rm -rf $(VENV) build dist *.egg-info
