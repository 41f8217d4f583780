#!/usr/bin/env bash
# The functional cases on one lent H200 (issue 5's GPU part), in one device call:
#   bash tests/functional_tests/run_h200.sh            (on the GPU machine; $OUT comes back)
# Installs the carried megatron-core wheel and this package into /tmp/site (no network there),
# trains every case whose PLATFORMS lists h200 (spool only: chDB is not on the GPU machine), runs
# tiny_router_attn a second time with the same seed, and packs the work folders into
# $OUT/ft_h200.tgz. Here, where chDB exists, record and check the golden values with
#   tar xzf ft_h200.tgz -C /tmp && python -m tests.functional_tests.runner --platform h200 \
#       --workdir /tmp/ft_h200 --compare-only --record-golden
set -uo pipefail
OUT=${OUT:-/tmp/out}
cd "$(dirname "$0")/../.."
source scripts/h200_env.sh
# --deterministic-mode needs NCCL_ALGO set (megatron asserts it) and a cuBLAS workspace config
export CUBLAS_WORKSPACE_CONFIG=:4096:8 NCCL_ALGO=Ring
rm -rf /tmp/ft_h200 /tmp/ft_h200_repeat
# FT_CASES="dir ..." runs only those cases; FT_REPEAT=0 skips the same-seed repeat
CASE_ARGS=(); for c in ${FT_CASES:-}; do CASE_ARGS+=(--case "$c"); done
timeout ${FT_TIMEOUT:-480} python3 -m tests.functional_tests.runner --platform h200 --launch-only --workdir /tmp/ft_h200 \
  "${CASE_ARGS[@]}" 2>&1 | tee $OUT/ft_launch.log
if [ "${FT_REPEAT:-1}" = 1 ]; then
  timeout 120 python3 -m tests.functional_tests.runner --platform h200 --launch-only \
    --case tests/functional_tests/test_cases/gpt_moe/tiny_router_attn --workdir /tmp/ft_h200_repeat 2>&1 | tee -a $OUT/ft_launch.log
fi
tar czf $OUT/ft_h200.tgz -C /tmp $(cd /tmp && ls -d ft_h200 ft_h200_repeat 2>/dev/null)
# the native ring's own GPU tests (CUDA build, graph replays, drain throughput), if time is left
[ "${WITH_NATIVE:-1}" = 1 ] && DMI_RESULTS_DIR=$OUT timeout 150 bash tests/gpu/run_native_gpu.sh 2>&1 | tail -5
