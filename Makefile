# `make run`: set up a virtualenv and run the tiny ScaleRL job end to end.
# `make test`: set up a virtualenv and run the default test suite.
PY ?= python3
VENV ?= .venv
BIN = $(VENV)/bin
WORKDIR ?= runs/tiny

$(BIN)/.installed: requirements.txt requirements-jetstream.txt requirements-test.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements.txt -r requirements-test.txt
	$(BIN)/pip install -q --no-deps -r requirements-jetstream.txt
	touch $@

venv: $(BIN)/.installed

run: venv
	JAX_PLATFORMS=cpu $(BIN)/python launch/run.py --config=configs/tiny.py --workdir=$(WORKDIR)

test: venv
	JAX_PLATFORMS=cpu $(BIN)/python -m pytest -n 2 -q tests

test-slow: venv
	JAX_PLATFORMS=cpu $(BIN)/python -m pytest -n 2 -q -m slow tests

bench: venv
	JAX_PLATFORMS=cpu $(BIN)/python launch/bench.py

.PHONY: venv run test test-slow bench
