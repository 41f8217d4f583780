#!/usr/bin/env bash
# README's first command: set up, train a tiny MoE GPT with DMI capturing the router into embedded
# ClickHouse (CPU development mode when no GPU is visible), then read it back.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
source examples/tiny_moe_args.sh
STORE=${STORE:-dmi_store/quickstart}
rm -rf "$STORE"
DEVICE_ARGS=(--cpu-dev-mode)
if .venv/bin/python -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  DEVICE_ARGS=()
fi
.venv/bin/python pretrain_gpt.py "${TINY_MOE_ARGS[@]}" "${DEVICE_ARGS[@]}" \
  --dmi-hooks router --dmi-persist clickhouse --dmi-store-dir "$STORE" 2>&1 | grep -E "DMI|iteration +[0-9]+/|rank [0-9]+:"
.venv/bin/megatron-dmi show "$STORE"  # the fast reading CLI (no megatron-core import, no warnings)
