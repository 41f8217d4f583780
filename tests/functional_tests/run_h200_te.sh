#!/usr/bin/env bash
# The Transformer Engine cases (test_cases/gpt_moe_te, platform h200_te) on one lent H200, in one
# device call (issue 18). TE comes from shared/te-h200, copied into the ignored .te-h200/ and carried
# with the megatron-core wheel in .whl/:
#   bash .te-h200/install_te.sh bash tests/functional_tests/run_h200_te.sh
# It checks TE on the GPU (gpu_check.py), builds the native ring once, trains every h200_te case
# with the in-run oracle (not the CUDA-graph cases: an oracle hook cannot copy to the host inside a
# graph capture) and a DMI-off twin of each, several at a time (tiny models: the GPU has room), plus
# the extra h200 cases in $FT_H200_CASES (with the oracle and a twin too where they can; FT_TE=0 runs
# only those; FT_TE_CASES="<case dirs>" runs those TE cases instead of all), then clocks DMI's host time per firing (host_cost.py).
# Nothing here needs chDB: every DMI run spools (--dmi-persist spool), and a replay case (no DMI-off twin:
# it trains under another run's routing) reads its recording run's spool directly (reader/spool.py).
# Everything is packed into $OUT/ft_h200_te.tgz.part_*; here, with chDB, unpack
# (cat ft_h200_te.tgz.part_* | tar xz -C /tmp), then check and record with
#   python -m tests.functional_tests.check_h200_te /tmp/ft_h200_te [--record-golden]
set -uo pipefail
OUT=${OUT:-/tmp/out}
cd "$(dirname "$0")/../.."
W=/tmp/ft_h200_te
rm -rf $W && mkdir -p $W
GPU_TXT=$W/gpu.txt source scripts/h200_env.sh
# --deterministic-mode needs NCCL_ALGO set (megatron asserts it) and a cuBLAS workspace config
export CUBLAS_WORKSPACE_CONFIG=:4096:8 NCCL_ALGO=Ring
timeout 90 python3 .te-h200/gpu_check.py > $W/gpu_check.log 2>&1; echo "gpu_check rc=$? $(tail -1 $W/gpu_check.log)"
timeout 240 python3 -m megatron.core.dmi doctor --build --check-cuda > $W/doctor.log 2>&1; echo "doctor rc=$?"
grep -v -E "^ok " $W/doctor.log | head -20
{
  [ "${FT_TE:-1}" = 1 ] && for c in ${FT_TE_CASES:-tests/functional_tests/test_cases/gpt_moe_te/*/}; do
    c=${c%/}
    case $c in *graph*) echo "h200_te $c dmi" ;; *) echo "h200_te $c oracle" ;; esac
    case $c in *replay*) ;; *) echo "h200_te $c off" ;; esac  # a replay trains under another run's routing
  done
  for c in ${FT_H200_CASES:-}; do  # a killed-and-resumed case runs alone: its twin would be killed too
    case $c in *graph*|*ckpt*) echo "h200 $c dmi" ;; *) echo "h200 $c oracle" ;; esac
    case $c in *ckpt*) ;; *) echo "h200 $c off" ;; esac
  done
} > $W/jobs.txt
one() {  # platform case mode
  local name=$(basename $2) flags=(--platform $1 --case $2 --launch-only)
  [ $3 = oracle ] && flags+=(--oracle)
  [ $3 = off ] && flags+=(--no-dmi) && name=${name}_off
  timeout 300 python3 -m tests.functional_tests.runner "${flags[@]}" --workdir $W/$name > $W/$name.runner.log 2>&1
  local rc=$?
  echo "$(date +%T) $name rc=$rc $(cat $W/$name/train*.log 2>/dev/null | grep -m1 -E '^\[rank0\]: [A-Za-z.]*(Error|Exception)' | cut -c1-200)"
}
export -f one; export W
timeout ${FT_TIMEOUT:-330} xargs -P ${FT_PARALLEL:-8} -L 1 bash -c 'one "$@"' _ < $W/jobs.txt
if [ "${WITH_HOST_COST:-1}" = 1 ]; then
  timeout 150 python3 benchmarks/host_cost.py --device cuda --out $OUT/host_cost_h200.json > $W/host_cost.log 2>&1
  echo "host_cost rc=$?"; tail -6 $W/host_cost.log
fi
find $W -name "*.pt" -path "*checkpoints*" -delete 2>/dev/null
# a file that comes back from the machine is at most 16 MiB: the archive travels in parts
tar czf - -C /tmp ft_h200_te | split -b 15M - $OUT/ft_h200_te.tgz.part_
ls -la $OUT
