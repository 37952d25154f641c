# One-command set-up + run. Everything installs into a project-local .venv (see README).
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
EXTRAS ?= cpu,test,bench
TINY_MODELS_DIR ?= .cache/tiny-models
export OPD_TINY_MODELS_DIR := $(abspath $(TINY_MODELS_DIR))

.PHONY: setup demo test unit lint bench clean

# Re-installs only when pyproject.toml changes, so `make test` twice costs nothing extra.
$(STAMP): pyproject.toml scripts/setup_venv.sh
	PYTHON=$(PYTHON) EXTRAS=$(EXTRAS) bash scripts/setup_venv.sh $(VENV)
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(BIN)/opd make-tiny-models $(TINY_MODELS_DIR)
	$(BIN)/opd roundtrip --models-dir $(TINY_MODELS_DIR)

test: setup
	$(BIN)/ruff check .
	$(BIN)/opd make-tiny-models $(TINY_MODELS_DIR)
	$(BIN)/pytest -ra

unit: setup
	$(BIN)/pytest -ra tests/unit

lint: setup
	$(BIN)/ruff check .

bench: setup
	$(BIN)/python benchmarks/engine_throughput.py --models-dir $(TINY_MODELS_DIR)

clean:
	rm -rf $(VENV) .cache runs
