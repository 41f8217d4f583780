#!/usr/bin/env bash
# Create (or reuse) .venv with Python 3.12 and install this package with its test extra.
# pip's download cache (~/.cache/pip) makes repeated set-ups fast.
set -euo pipefail
cd "$(dirname "$0")/.."
find_python() {
  if [ -n "${PYTHON:-}" ]; then echo "$PYTHON"; return; fi
  for c in python3.12 python3.13; do command -v "$c" >/dev/null && { command -v "$c"; return; }; done
  if command -v pyenv >/dev/null; then
    for v in "$(pyenv root)"/versions/3.1[23].*/bin/python3.1[23]; do [ -x "$v" ] && { echo "$v"; return; }; done
  fi
  echo "error: megatron-core 0.17.1 needs Python >= 3.12; none found (set PYTHON=/path/to/python3.12)" >&2
  exit 1
}
if [ ! -x .venv/bin/python ]; then
  "$(find_python)" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[test]'
