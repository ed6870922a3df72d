# `make run`: set up a virtualenv and run the tiny ScaleRL job end to end.
# `make test`: set up a virtualenv and run the default test suite.
PY ?= python3
VENV ?= .venv
BIN = $(VENV)/bin
WORKDIR ?= runs/tiny

$(BIN)/.installed: requirements.txt requirements-jetstream.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements.txt
	$(BIN)/pip install -q --no-deps -r requirements-jetstream.txt
	touch $@

$(BIN)/.installed-test: $(BIN)/.installed requirements-test.txt
	$(BIN)/pip install -q -r requirements-test.txt
	touch $@

venv: $(BIN)/.installed

run: venv
	JAX_PLATFORMS=cpu $(BIN)/python launch/run.py --config=configs/tiny.py --workdir=$(WORKDIR)

lint: $(BIN)/.installed-test
	$(BIN)/ruff check .

test: lint
	JAX_PLATFORMS=cpu $(BIN)/python -m pytest -n 2 -q tests

$(BIN)/.installed-tpu: $(BIN)/.installed-test requirements-tpu.txt
	$(BIN)/pip install -q -r requirements-tpu.txt
	touch $@

# Slow checks: two-process runs, the pipeline and server runs, the calibration study, the notebook.
test-slow: $(BIN)/.installed-test
	JAX_PLATFORMS=cpu $(BIN)/python -m pytest -n 2 -q -m slow tests --ignore=tests/test_dry_run.py --ignore=tests/test_distributed.py

# Ahead-of-time TPU compiles of the full-size configs (libtpu, ~700 MB): every test of
# test_dry_run.py, fast ones included (they skip without libtpu in `make test`), and the
# two-process jax.distributed checks.
test-aot: $(BIN)/.installed-tpu
	JAX_PLATFORMS=cpu $(BIN)/python -m pytest -n 2 -q -m "slow or not slow" tests/test_dry_run.py
	JAX_PLATFORMS=cpu $(BIN)/python -m pytest -n 2 -q -m slow tests/test_distributed.py

bench: $(BIN)/.installed-test
	JAX_PLATFORMS=cpu $(BIN)/python launch/bench.py

# Side by side with google-tunix (../shared/peers builds its venv): alternating processes,
# medians and per-pair ratios (~20 min on a quiet 2-core machine).
bench-peers: $(BIN)/.installed-test
	bash ../shared/peers/setup.sh
	JAX_PLATFORMS=cpu $(BIN)/python launch/bench.py --vs_tunix --rounds=5

.PHONY: venv lint run test test-slow test-aot bench bench-peers
