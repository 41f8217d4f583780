// Router selection in one kernel (CUDA build): what the router hook records besides the logits.
//
// Per token (one thread each): the top-k experts ordered by pre-drop probability, descending,
// ties to the lower expert id (a stable sort), with the sentinel E where capacity dropped the
// route and its weight 0; and per expert the tokens routed before and after dropping. The torch
// reference (megatron/core/dmi/hooks/router.py: topk_view, expert_counts) takes about twenty small
// kernels and as many host launches per MoE layer; this takes a memset and one launch, which
// matters because an eager MoE step is host-bound. Results are bitwise those of the reference.
//
// Scores are compared as order-preserving integer keys rather than floats: the CUDA build is
// compiled with --use_fast_math, whose flush-to-zero would make distinct subnormal scores tie.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "router_select.h"

namespace dmi {

namespace {

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

// Total order of torch's descending sort on float32: NaN above everything, -0 equal to +0.
__device__ __forceinline__ uint32_t order_key(float v) {
  uint32_t b = __float_as_uint(v);
  if ((b & 0x7fffffffu) > 0x7f800000u) return 0xffffffffu;  // NaN
  if (b == 0x80000000u) b = 0;                               // -0 ties with +0
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

template <typename T>
__global__ void dmi_router_select(const T* __restrict__ probs, const bool* __restrict__ routing_map,
                                  const T* __restrict__ pre_probs, const bool* __restrict__ pre_map, int64_t tokens,
                                  int experts, int k, int32_t* __restrict__ ids, T* __restrict__ weights,
                                  int32_t* __restrict__ counts) {
  extern __shared__ int32_t hist[];  // [2][experts]: before, after dropping
  for (int i = threadIdx.x; i < 2 * experts; i += blockDim.x) hist[i] = 0;
  __syncthreads();
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t < tokens) {
    const int64_t row = t * experts;
    uint32_t best_key[kRouterSelectMaxK];
    int best_id[kRouterSelectMaxK];
    int filled = 0;
    for (int e = 0; e < experts; ++e) {
      const bool chosen = pre_map[row + e];
      if (chosen) atomicAdd(&hist[e], 1);
      if (routing_map[row + e]) atomicAdd(&hist[experts + e], 1);
      // Unchosen experts rank below every chosen one, among themselves by id (the reference
      // masks them to -inf, whose key is the lowest of any non-NaN float).
      const uint32_t key = chosen ? order_key(to_float(pre_probs[row + e])) : order_key(-INFINITY);
      int pos = filled;
      while (pos > 0 && key > best_key[pos - 1]) --pos;  // strictly greater: earlier ids win ties
      if (pos >= k) continue;
      const int last = filled < k ? filled : k - 1;
      for (int j = last; j > pos; --j) {
        best_key[j] = best_key[j - 1];
        best_id[j] = best_id[j - 1];
      }
      best_key[pos] = key;
      best_id[pos] = e;
      if (filled < k) ++filled;
    }
    for (int j = 0; j < k; ++j) {
      const int e = best_id[j];
      const bool kept = routing_map[row + e];
      const T p = probs[row + e];
      ids[t * k + j] = kept ? e : experts;
      // kept: the probability itself; dropped: p * 0 as the reference computes it (+-0, NaN stays NaN)
      weights[t * k + j] = kept ? p : from_float<T>(to_float(p) * 0.0f);
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < 2 * experts; i += blockDim.x)
    if (hist[i]) atomicAdd(&counts[i], hist[i]);
}

template <typename T>
cudaError_t launch(const RouterSelectArgs& a, cudaStream_t stream) {
  cudaError_t err = cudaMemsetAsync(a.counts, 0, sizeof(int32_t) * 2 * a.experts, stream);
  if (err != cudaSuccess || a.tokens == 0) return err;
  constexpr int threads = 128;
  const int64_t blocks = (a.tokens + threads - 1) / threads;
  const size_t shared = sizeof(int32_t) * 2 * a.experts;
  dmi_router_select<T><<<static_cast<unsigned>(blocks), threads, shared, stream>>>(
      static_cast<const T*>(a.probs), a.routing_map, static_cast<const T*>(a.pre_probs), a.pre_map, a.tokens,
      a.experts, a.k, a.ids, static_cast<T*>(a.weights), a.counts);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_router_select(const RouterSelectArgs& args, cudaStream_t stream) {
  switch (args.dtype) {
    case RouterDtype::kFloat32:
      return launch<float>(args, stream);
    case RouterDtype::kBFloat16:
      return launch<__nv_bfloat16>(args, stream);
    case RouterDtype::kFloat16:
      return launch<__half>(args, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace dmi
