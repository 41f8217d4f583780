# Sourced (from the repository root, $OUT set) by every script that runs on a lent H200: installs the
# carried megatron-core wheel (.whl/), any wheels given as arguments and this package into /tmp/site
# in one pip call (no network there; --target replaces, not merges, a top-level folder installed
# earlier), sets the environment all of them share and writes the GPU's name to ${GPU_TXT:-$OUT/gpu.txt}.
#   source scripts/h200_env.sh [.whl-chdb/*.whl ...]
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site \
  .whl/*.whl "$@" . || exit 1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0
# NVLink multicast stays off on the lent machines (the device notes)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "${GPU_TXT:-$OUT/gpu.txt}"
