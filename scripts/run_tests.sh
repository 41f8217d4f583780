#!/usr/bin/env bash
# The test command of README.md: set up .venv, then run every test that works on this machine
# (GPU tests skip themselves without a CUDA device).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
# Lint and format check first: a style slip fails in seconds, not after the suite.
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# One worker per core (pytest-xdist): the fault and end-to-end tests spend a third of their time
# waiting on subprocesses, servers and timeouts, which a second worker fills (fault_tests: 927 s -> 453 s
# on 2 cores). Pass -n 0 to run in one process.
exec .venv/bin/python -m pytest tests -q -n auto "$@"
