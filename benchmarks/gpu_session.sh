#!/usr/bin/env bash
# Everything this project runs on one lent H200, in one call (device time is scarce):
#   1. install the carried megatron-core wheel and this package into /tmp/site (no network there);
#   2. pretrain_gpt.py on the GPU: DMI off, router+attn spooled, the same with selective recompute,
#      and a dense model with --cuda-graph-impl local: losses must be identical with and without DMI;
#   3. the overhead benchmark (benchmarks/overhead.py), quick or full.
# Spool files and logs are packed under $OUT for checking here (chDB is not on the GPU machine).
#   bash benchmarks/gpu_session.sh quick|full|bench
set -uo pipefail
MODE=${1:-quick}
OUT=${OUT:-/tmp/out}
cd "$(dirname "$0")/.."
source scripts/h200_env.sh
export NCCL_ALGO=Ring CUBLAS_WORKSPACE_CONFIG=:4096:8
source examples/tiny_moe_args.sh
if [ "$MODE" = bench ]; then  # the benchmark alone
  timeout ${BENCH_TIMEOUT:-480} python3 benchmarks/overhead.py --out $OUT/overhead_h200.json ${BENCH_ARGS:-} > $OUT/bench.log 2>&1
  grep -E "^round|graph arms|^[a-z_]+ +[0-9]|^profile|DMI host time" $OUT/bench.log | tail -40; tail -3 $OUT/bench.log
  exit
fi
train() {  # name, extra args...
  local name=$1; shift
  rm -rf /tmp/run_$name
  timeout 300 python3 -m torch.distributed.run --nproc-per-node 1 --master-port 29511 pretrain_gpt.py \
    "${TINY_MOE_ARGS[@]}" --train-iters 6 "$@" > $OUT/train_$name.log 2>&1
  echo "train $name rc=$? $(grep -c 'lm loss' $OUT/train_$name.log) loss lines; $(grep -E 'DMI end-of-run' -A1 $OUT/train_$name.log | tail -1)"
  grep -o 'lm loss: [0-9.E+-]*' $OUT/train_$name.log > $OUT/loss_$name.txt
}
train off
train dmi --dmi-hooks router,attn --dmi-persist spool --dmi-store-dir /tmp/run_dmi/store
train dmi_recompute --dmi-hooks router,attn --dmi-persist spool --dmi-store-dir /tmp/run_dmi_recompute/store \
  --recompute-granularity selective --recompute-modules core_attn
DENSE=(--num-experts 0)
train dense_graph_off --cuda-graph-impl local "${DENSE[@]}"
train dense_graph_dmi --cuda-graph-impl local --dmi-hooks attn --dmi-persist spool \
  --dmi-store-dir /tmp/run_dense_graph_dmi/store "${DENSE[@]}"
for a in dmi dmi_recompute; do cmp -s $OUT/loss_off.txt $OUT/loss_$a.txt && echo "loss $a == off (bitwise)" || echo "loss $a DIFFERS from off"; done
cmp -s $OUT/loss_dense_graph_off.txt $OUT/loss_dense_graph_dmi.txt && echo "loss dense_graph_dmi == dense_graph_off" || echo "loss dense_graph_dmi DIFFERS"
tar czf $OUT/spools.tgz -C /tmp $(cd /tmp && ls -d run_*/store 2>/dev/null) 2>/dev/null
tar czf $OUT/train_logs.tgz -C $OUT $(cd $OUT && ls train_*.log loss_*.txt) && rm -f $OUT/train_*.log $OUT/loss_*.txt
if [ "$MODE" = quick ]; then
  timeout 240 python3 benchmarks/overhead.py --quick --out $OUT/overhead_quick.json 2>&1 | tail -15
else
  timeout 420 python3 benchmarks/overhead.py --out $OUT/overhead_h200.json 2>&1 | tail -25
fi
