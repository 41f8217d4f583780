// CUDA build of the DMI ring: device-side control block and the launch interface between the
// kernels (cuda_ring.cu, compiled by nvcc) and the ring object / bindings (cuda_ring_bind.cpp).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "ring_protocol.h"

namespace dmi {

// Per-launch scratch: the reserve kernel writes where the slot is, the copy kernel reads it and
// counts finished blocks; the last block publishes the descriptor.
struct Ticket {
  uint64_t accepted;
  uint64_t offset;
  uint64_t seq;
  uint32_t done;
  uint32_t pad;
};

// Device memory (cudaMalloc). The host never reads it on the hot path: counters are mirrored
// into Shared (mapped host memory) by the producers.
struct DevCtrl {
  uint64_t head;  // virtual reservation position
  uint64_t seq;   // next sequence number
  uint64_t accepted_bytes;
  uint64_t dropped;
  uint64_t dropped_bytes;
  uint64_t rejected;
  uint64_t timeouts;
  uint64_t blocked_ns;
  uint64_t blocked;
  int32_t lock;   // producer spin lock (reservation order == sequence order)
  int32_t gate;   // int32 device gate, set by the host before each step / graph replay
  int64_t ctx[kCtxWords];  // context block: iteration, microbatch, attempt, phase, invocation
  Ticket tickets[kNumTickets];
};

// Everything a producer needs, passed by value (fixed addresses: safe to capture in CUDA graphs).
struct DevRing {
  DevCtrl* ctrl;
  Shared* shared;   // device alias of the mapped host block
  Desc* descs;      // device alias of the mapped host descriptor ring
  uint8_t* payload;
  uint64_t cap;
  uint64_t desc_cap;
  int32_t on_full;
  uint64_t block_timeout_ns;
};

// Shared::pad0[0] is the `closing` word: once set, producers waiting for space give up (drop).
constexpr int kClosingWord = 0;

// Explicit context words for one record (eager publish(key, tensor)); `use` = 0 reads the device
// context block instead (graph-capturable publish_site path).
struct CtxArg {
  int64_t w[kFiringWords];
  int32_t use;
};

// Several records published by one pair of launches (eager path: explicit context words each).
struct GroupArg {
  int32_t n;
  uint32_t site[kMaxGroup];
  int32_t ticket[kMaxGroup];
  const void* src[kMaxGroup];
  uint64_t nbytes[kMaxGroup];
  int64_t ctx[kMaxGroup][kFiringWords];
};

cudaError_t launch_publish_group(const DevRing& r, const GroupArg& g, uint32_t mask, int max_blocks,
                                 cudaStream_t stream);

cudaError_t launch_publish(const DevRing& r, const void* src, uint64_t nbytes, uint32_t site, uint32_t mask,
                           const CtxArg& ctx, int ticket, int max_blocks, cudaStream_t stream);

}  // namespace dmi
