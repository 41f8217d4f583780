# Arguments of a tiny MoE GPT (2 layers, 4 experts, top-2) that trains on a CPU in seconds.
# Source this file, then: python pretrain_gpt.py "${TINY_MOE_ARGS[@]}" --cpu-dev-mode --dmi-hooks router
TINY_MOE_ARGS=(
  --num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4
  --seq-length 32 --max-position-embeddings 32
  --micro-batch-size 2 --global-batch-size 4 --train-iters 4 --lr 1e-3 --seed 1234
  --mock-data --tokenizer-type NullTokenizer --vocab-size 128
  --num-experts 4 --moe-router-topk 2 --moe-token-dispatcher-type allgather --disable-bias-linear
  --transformer-impl local --no-rope-fusion --no-masked-softmax-fusion --no-persist-layer-norm
  --no-gradient-accumulation-fusion --deterministic-mode
  --log-interval 1 --eval-iters 0 --eval-interval 1000
)
