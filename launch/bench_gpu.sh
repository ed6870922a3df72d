#!/usr/bin/env bash
# The accelerator benchmark of docs/benchmarks.md ("GPU"): the 1b preset's train, sampler, RL and
# Hugging Face cases in one process, JSON lines on stdout. Under 8 minutes on an H200 including
# compiles (the hf case drops the settings that would start too late: launch/bench.py --budget_s).
#
# On a machine without the project's pins (the H200 image lacks grain, ml-collections, ...): run
# `bash ../shared/gpu/prepare_wheels.sh` in the checkout first and carry `.whl`; they are installed
# into /tmp/site here. Extra arguments go to bench.py (e.g. --cases=sampler,hf).
set -uo pipefail
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH="/tmp/site"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the checkout, where `make venv` has not installed it
echo "{\"commit\": \"$(git rev-parse --short HEAD 2>/dev/null || echo unknown)\", \"date\": \"$(date -u +%FT%TZ)\"}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
exec timeout 470 python3 launch/bench.py --preset=1b --cases=train,sampler,rl,hf "$@"
