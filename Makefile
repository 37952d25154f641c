# One-command set-up + run. Everything installs into a project-local .venv (see README).
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
EXTRAS ?= cpu,test,bench
# The example job files point at this folder (relative to examples/*/).
TINY_MODELS_DIR := .cache/tiny-models
export OPD_TINY_MODELS_DIR := $(abspath $(TINY_MODELS_DIR))

.PHONY: setup demo test unit lint bench clean

# Re-installs only when pyproject.toml changes, so `make test` twice costs nothing extra.
$(STAMP): pyproject.toml scripts/setup_venv.sh
	PYTHON=$(PYTHON) EXTRAS=$(EXTRAS) bash scripts/setup_venv.sh $(VENV)
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(BIN)/opd make-tiny-models $(TINY_MODELS_DIR)
	$(BIN)/opd train examples/model_opd_tiny/job.yaml

# Unit tests run in their own process first: fast feedback, and no torch/transformers imported
# around the classpath loader's import-isolation checks.
test: setup
	$(BIN)/ruff check .
	$(BIN)/pytest -ra tests/unit
	$(BIN)/opd make-tiny-models $(TINY_MODELS_DIR)
	$(BIN)/pytest -ra tests/deploy tests/api tests/integration

unit: setup
	$(BIN)/pytest -ra tests/unit

lint: setup
	$(BIN)/ruff check .

bench: setup
	$(BIN)/python benchmarks/engine_throughput.py --models-dir $(TINY_MODELS_DIR)

clean:
	rm -rf $(VENV) .cache runs
