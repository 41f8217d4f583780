#!/usr/bin/env bash
# GPU tests of the native DMI ring and the router-selection kernel. Installs nothing: needs python3 with torch, numpy, pyarrow,
# pytest, ninja and nvcc (CUDA_HOME or nvcc on PATH). Results JSON goes to $DMI_RESULTS_DIR if set.
#   tests/gpu/run_native_gpu.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export PYTHONUNBUFFERED=1
exec python3 -m pytest tests/gpu/test_native_ring_gpu.py tests/gpu/test_router_select_gpu.py -q -s -p no:cacheprovider "$@"
