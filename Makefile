# Everything a fresh machine needs: `make test` and `make demo` (see README.md).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup services test test-fast demo bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): requirements-dev.txt pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements-dev.txt
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

setup: $(STAMP)

# The local one-node SLURM cluster the submitit tests submit to (idempotent, quick when running).
services:
	./ci/slurm_up.sh

test: setup services
	$(BIN)/python -m pytest -q

# The suite without the SLURM tests, for quick local iterations.
test-fast: setup
	$(BIN)/python -m pytest -q -m "not slurm"

demo: setup
	$(BIN)/rlharvest demo

bench: setup
	$(BIN)/rlharvest bench

clean:
	rm -rf $(VENV) demo_out log_test build *.egg-info
