# One entry point for set-up, tests, demo and engines. Every target creates .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv test demo clean
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

clean:
	rm -rf $(VENV) build dist *.egg-info
