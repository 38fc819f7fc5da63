# Everything a fresh machine needs: `make test` and `make demo` (see README.md).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The TorchRL compatibility suite's venv: rlharvest beside TorchRL 0.14.1 (tests only).
TRL_VENV  ?= .venv-torchrl14
TRL_STAMP := $(TRL_VENV)/.installed

.PHONY: setup setup-torchrl services test test-fast test-torchrl demo bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): requirements-dev.txt pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements-dev.txt
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

setup: $(STAMP)

$(TRL_STAMP): compat/requirements.txt pyproject.toml
	test -x $(TRL_VENV)/bin/python || $(PYTHON) -m venv $(TRL_VENV)
	$(TRL_VENV)/bin/python -m pip install -q --upgrade pip
	$(TRL_VENV)/bin/python -m pip install -q -r compat/requirements.txt
	$(TRL_VENV)/bin/python -m pip install -q --no-deps --no-build-isolation -e .
	touch $(TRL_STAMP)

setup-torchrl: $(TRL_STAMP)

# The local one-node SLURM cluster the submitit tests submit to (idempotent, quick when running), and
# the headless Chromium the monitor's page tests drive (idempotent).
services:
	./ci/slurm_up.sh
	./ci/chromium_up.sh

# Two pytest processes over independent files (Ray tests in one, with one Ray; SLURM tests in one).
test: setup setup-torchrl services
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup --durations=25
	cd compat && ../$(TRL_VENV)/bin/python -m pytest -q -n 2

# rlharvest's collectors with TorchRL 0.14.1's envs, policies and replay buffers (compat/).
test-torchrl: setup-torchrl
	cd compat && ../$(TRL_VENV)/bin/python -m pytest -q -n 2

# The suite without the SLURM tests, for quick local iterations.
test-fast: setup
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup -m "not slurm"

demo: setup
	$(BIN)/rlharvest demo

bench: setup
	$(BIN)/rlharvest bench

clean:
	rm -rf $(VENV) $(TRL_VENV) demo_out log_test build *.egg-info
