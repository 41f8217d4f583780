// Router selection kernel (router_select.cu): launch interface for the bindings.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "ring_protocol.h"  // RouterDtype, kRouterSelectMaxK, kRouterSelectMaxExperts

namespace dmi {

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
