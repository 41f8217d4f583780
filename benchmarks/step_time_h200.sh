#!/usr/bin/env bash
# Megatron's own step time with DMI on the H200, through the real entry point (issues 18 and 22), in
# one device call. Carry the megatron-core wheel in .whl/ and chdb-core-lite in .whl-chdb/:
#   bash benchmarks/step_time_h200.sh
# The model is benchmarks/overhead.py's (8 layers, h2048, 16 experts top-4, seq 4096, bf16, local
# spec). Runs one after another, each pretrain_gpt.py with --log-interval 1:
#   off, off2    DMI off, twice (the floor between two runs; odd and even iterations of one are the
#                in-process A/A pair)
#   alt_router   --dmi-hooks router --dmi-interval 2: odd iterations captured, even ones not
#   alt_attn     --dmi-hooks router,attn --dmi-interval 2
#   router       --dmi-hooks router --dmi-persist spool, every iteration (issue 30's user number)
#   spool        --dmi-hooks router,attn --dmi-persist spool, every iteration
#   clickhouse   --dmi-hooks router,attn --dmi-persist clickhouse (embedded chDB, the node's ingester
#                process), every iteration: the user's command
# then loads the spool run's segments into a fresh store (`megatron-dmi load`, timed: ingest GB/s),
# reads the clickhouse store back (`megatron-dmi show`), and clocks DMI's host time per firing
# (host_cost.py). Logs and JSON come back in $OUT; analyse here with benchmarks/step_time.py.
set -uo pipefail
OUT=${OUT:-/tmp/out}
cd "$(dirname "$0")/.."
source scripts/h200_env.sh .whl-chdb/*.whl
python3 -c "import chdb; print('chdb', chdb.__version__, chdb.engine_version if hasattr(chdb, 'engine_version') else '')" 2>&1 | tee -a $OUT/gpu.txt
python3 -m megatron.core.dmi doctor --build > $OUT/doctor.log 2>&1; grep -E "chdb|jit build" $OUT/doctor.log
W=/tmp/step_time; rm -rf $W; mkdir -p $W
MODEL=(--num-layers 8 --hidden-size 2048 --ffn-hidden-size 8192 --num-attention-heads 16
  --num-experts 16 --moe-router-topk 4 --moe-ffn-hidden-size 2048 --moe-token-dispatcher-type alltoall
  --moe-router-load-balancing-type none --moe-router-dtype fp32
  --seq-length 4096 --max-position-embeddings 4096 --micro-batch-size 2 --global-batch-size 2
  --vocab-size 32768 --tokenizer-type NullTokenizer --mock-data --bf16 --lr 1e-4 --disable-bias-linear
  --transformer-impl local --no-rope-fusion --no-masked-softmax-fusion --no-persist-layer-norm
  --no-gradient-accumulation-fusion --log-interval 1 --eval-iters 0 --eval-interval 100000 --seed 1234)
ITERS=${ITERS:-40}
train() {  # name, extra args...
  local name=$1; shift
  timeout ${RUN_TIMEOUT:-150} python3 -m torch.distributed.run --nproc-per-node 1 --master-port 29533 pretrain_gpt.py \
    "${MODEL[@]}" --train-iters $ITERS "$@" > $OUT/$name.log 2>&1
  echo "$name rc=$? $(grep -c 'elapsed time per iteration' $OUT/$name.log) iterations; $(grep -A1 'DMI end-of-run' $OUT/$name.log | tail -1)"
}
DMI=(--dmi-ring-mb 4096 --dmi-store-dir)
RUNS=${RUNS:-off alt_router alt_attn spool clickhouse off2}  # a subset: RUNS="off spool clickhouse off2"
for run in $RUNS; do
  case $run in
    off|off2) train $run ;;
    alt_router) train alt_router --dmi-hooks router --dmi-interval 2 --dmi-persist spool "${DMI[@]}" $W/alt_router ;;
    alt_attn) train alt_attn --dmi-hooks router,attn --dmi-interval 2 --dmi-persist spool "${DMI[@]}" $W/alt_attn ;;
    router) train router --dmi-hooks router --dmi-persist spool "${DMI[@]}" $W/router ;;
    spool) train spool --dmi-hooks router,attn --dmi-persist spool "${DMI[@]}" $W/spool ;;
    clickhouse) train clickhouse --dmi-hooks router,attn --dmi-persist clickhouse "${DMI[@]}" $W/clickhouse ;;
  esac
done
rm -rf $W/alt_router $W/alt_attn $W/router
if [ -d $W/spool ]; then  # ingest speed: the spool run's segments loaded into a fresh store
  du -sb $W/spool/spool | tee $OUT/spool_bytes.txt
  t0=$EPOCHREALTIME; python3 -m megatron_dmi load $W/spool/spool --store $W/loaded > $OUT/load.log 2>&1; rc=$?
  echo "load rc=$rc wall $(python3 -c "print(round($EPOCHREALTIME - $t0, 2))") s" | tee -a $OUT/load.log; tail -3 $OUT/load.log
  rm -rf $W/spool $W/loaded
fi
if [ -d $W/clickhouse ]; then
  python3 -m megatron_dmi show $W/clickhouse > $OUT/show_clickhouse.txt 2>&1; echo "show rc=$?"; head -30 $OUT/show_clickhouse.txt
  du -sb $W/clickhouse | tee -a $OUT/store_bytes.txt
fi
if [ "${WITH_HOST_COST:-1}" = 1 ]; then
  timeout 150 python3 benchmarks/host_cost.py --device cuda --layers 8 --hidden 2048 --heads 16 --experts 16 --topk 4 \
    --seq 4096 --micro-batch 2 --vocab 32768 --out $OUT/host_cost_h200.json > $OUT/host_cost.log 2>&1
  echo "host_cost rc=$?"; tail -6 $OUT/host_cost.log
fi
# at most 8 files come back: the logs go in one archive
(cd $OUT && tar czf step_time_logs.tgz *.log *.txt && rm -f *.log *.txt); ls $OUT
