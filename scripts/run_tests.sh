#!/usr/bin/env bash
# The test command of README.md: set up .venv, then run every test that works on this machine
# (GPU tests skip themselves without a CUDA device).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
# Lint and format check first: a style slip fails in seconds, not after the suite.
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/python -m pytest tests -q "$@"
