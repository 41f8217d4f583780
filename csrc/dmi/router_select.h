// Router selection kernel (router_select.cu): launch interface for the bindings.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace dmi {

// Largest top-k and expert count the kernel takes (per-thread lists, per-block histograms); the
// Python side falls back to the torch reference beyond them.
constexpr int kRouterSelectMaxK = 32;
constexpr int kRouterSelectMaxExperts = 4096;

enum class RouterDtype : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// Row-major [tokens, experts] inputs, all contiguous on one device; outputs ids/weights [tokens, k]
// and counts [2, experts] (zeroed by the launch).
struct RouterSelectArgs {
  const void* probs;
  const bool* routing_map;
  const void* pre_probs;
  const bool* pre_map;
  int64_t tokens;
  int experts;
  int k;
  RouterDtype dtype;
  int32_t* ids;
  void* weights;
  int32_t* counts;
};

cudaError_t launch_router_select(const RouterSelectArgs& args, cudaStream_t stream);

}  // namespace dmi
