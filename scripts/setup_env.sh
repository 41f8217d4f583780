#!/usr/bin/env bash
# Create (or reuse) .venv with Python 3.12 and install this package with its test extra.
# pip's download cache (~/.cache/pip) makes repeated set-ups fast.
set -euo pipefail
cd "$(dirname "$0")/.."
works() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; }
find_python() {
  if [ -n "${PYTHON:-}" ]; then echo "$PYTHON"; return; fi
  local c
  # pyenv's shims exist for every installed version but fail unless it is selected: try each.
  for c in python3.12 python3.13 python3 \
           "$(pyenv root 2>/dev/null)"/versions/3.1[2-9].*/bin/python3; do
    if works "$c"; then command -v "$c"; return; fi
  done
  echo "error: megatron-core 0.17.1 needs Python >= 3.12; none found (set PYTHON=/path/to/python3.12)" >&2
  exit 1
}
if [ ! -x .venv/bin/python ]; then
  "$(find_python)" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[test]'
