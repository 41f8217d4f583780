// Megatron-DMI ring protocol: the data layout and arithmetic shared by the host build (CPU tensors,
// host_ring.cpp) and the CUDA build (cuda_ring.cu + cuda_ring_bind.cpp).
//
// Two rings:
//   * a payload ring of `cap` bytes. Positions are 64-bit *virtual* byte offsets that only grow;
//     the physical offset is `virtual % cap`. A slot is `align_up(nbytes, kSlotAlign)` bytes and is
//     always contiguous: when it would straddle the physical end, the reservation skips the rest of
//     the ring (the skipped bytes are freed together with the record).
//   * a descriptor ring of `desc_cap` Desc entries. Descriptor `seq` lives in entry
//     `seq % desc_cap`; its `ready` word becomes `seq + 1` when the payload is complete (written
//     last, with release semantics), so a stale entry can never be mistaken for a new one.
//
// A descriptor carries the record key explicitly: a static site id (registered from Python:
// output, layer, shard, shape, dtype, ...) plus the dynamic context words (iteration, microbatch,
// attempt, phase, invocation) read from the context block at reservation time. Nothing
// downstream pairs records by arrival order.
//
// Producer (one per record):  gate check -> [lock] -> wait for / check space -> reserve slot and
// sequence number -> [unlock] -> copy bytes -> publish descriptor.
// Drain (one thread): read descriptors in sequence order, copy their payload spans out, then free
// the ring space in order by advancing `tail` / `desc_tail` in the shared block.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#if defined(__CUDACC__)
#define DMI_HD __host__ __device__ __forceinline__
#else
#define DMI_HD inline
#endif

namespace dmi {

// The one C++ definition of every number and code the native builds share with Python. Each is
// exported to Python under its name without the k (SLOT_ALIGN, ...; the enums as name -> code
// dicts, the take row's column order as TAKE_COLUMNS) by bind_ring_common (bind_common.h) and
// checked against megatron/core/dmi/transport/abi.py whenever a build is loaded.
constexpr uint64_t kSlotAlign = 256;
constexpr int kCtxWords = 8;          // words of the device context block (the firing's and spare)
constexpr int kMaxGroup = 8;          // records per publish_group: one reserve and one copy launch
constexpr int kNumTickets = 1024;     // CUDA build: per-launch scratch (reserve -> copy kernel)

enum CtxWord : int {
  kCtxIteration = 0,
  kCtxMicrobatch = 1,
  kCtxAttempt = 2,
  kCtxPhase = 3,
  kCtxInvocation = 4,
};
constexpr int kFiringWords = kCtxInvocation + 1;  // the context words a descriptor carries
static_assert(kFiringWords <= kCtxWords, "the context block holds a firing's words");

// What a producer does when the ring is full. Any other code is refused by both builds'
// constructors (check_on_full), so no build can read an unknown code its own way.
enum OnFull : int { kDrop = 0, kBlock = 1 };

inline void check_on_full(int code) {
  if (code != kDrop && code != kBlock)
    throw std::invalid_argument("on_full code " + std::to_string(code) + " is neither drop (0) nor block (1)");
}

// Result of one producer call (host build returns it; CUDA build records it in device counters).
enum PublishResult : int { kRejected = -1, kDropped = 0, kAccepted = 1, kTimedOut = 2 };

// The router selection kernel's input dtypes (router_select.cu) and limits (per-thread lists,
// per-block histograms); the Python side falls back to the torch reference beyond them.
enum class RouterDtype : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };
constexpr int kRouterSelectMaxK = 32;
constexpr int kRouterSelectMaxExperts = 4096;

// One row of uint64 words per record handed to Python by take_into and stored by the native spool
// writer, in this column order (records.DESCRIPTOR_COLUMNS on the Python side).
enum TakeColumn : int {
  kTakeSeq = 0,
  kTakeSite,
  kTakeIteration,
  kTakeMicrobatch,
  kTakeAttempt,
  kTakePhase,
  kTakeInvocation,
  kTakeNbytes,
  kTakeCrc32,
};
constexpr int kTakeWords = kTakeCrc32 + 1;  // the row's length
constexpr const char* kTakeColumns[kTakeWords] = {"seq",   "site",       "iteration", "microbatch", "attempt",
                                                  "phase", "invocation", "nbytes",    "crc32"};

// One record's descriptor: exactly 64 bytes. In the CUDA build it lives in mapped pinned host
// memory (written by the producer kernels, read by the drain thread without any device sync).
struct alignas(64) Desc {
  uint64_t ready;    // seq + 1 once published; written last with release semantics
  uint64_t offset;   // physical byte offset of the slot in the payload ring
  uint64_t nbytes;   // payload bytes (0 for a zero-row record: it still gets a descriptor)
  uint64_t vend;     // virtual payload position just past this slot (ring tail after freeing it)
  int64_t iteration;
  int32_t microbatch;
  int32_t attempt;
  int32_t phase;
  int32_t invocation;
  uint32_t site;
  uint32_t flags;
};
static_assert(sizeof(Desc) == 64, "descriptor must stay 64 bytes");

// State the drain owns and the producers read (tail words), plus a mirror of the producer-side
// counters the host can read at any time without synchronising the device. CUDA build: mapped
// pinned host memory. Host build: plain memory accessed through atomics.
struct alignas(64) Shared {
  uint64_t tail;        // virtual payload position up to which space is free (drain writes)
  uint64_t desc_tail;   // first sequence number whose descriptor is not yet freed (drain writes)
  uint64_t pad0[6];
  // producer-side mirror, written under the producer lock
  uint64_t head;        // virtual payload reservation position
  uint64_t seq;         // next sequence number == records accepted so far
  uint64_t accepted_bytes;
  uint64_t dropped;     // drops for lack of space (on_full=drop) plus block timeouts
  uint64_t dropped_bytes;
  uint64_t rejected;    // refused by the gate: nothing published, nothing consumed
  uint64_t timeouts;    // block mode gave up after block_timeout (counted in dropped as well)
  uint64_t blocked_ns;  // block mode: time producers waited for space (backpressure on training)
  uint64_t blocked;     // block mode: records whose producer had to wait
  uint64_t pad1[7];
};

DMI_HD uint64_t align_up(uint64_t n, uint64_t a) { return (n + a - 1) / a * a; }

// Plan a slot of `span` bytes (already aligned) at reservation position `head` with the ring free
// up to `tail`. Returns false when it does not fit now. On success `*vstart` is the virtual start
// (possibly skipping the physical end of the ring so the slot stays contiguous).
DMI_HD bool plan_slot(uint64_t head, uint64_t tail, uint64_t span, uint64_t cap, uint64_t* vstart) {
  uint64_t start = head;
  if (span > 0) {
    uint64_t phys = start % cap;
    if (phys + span > cap) start += cap - phys;  // wrap: the slot starts at physical 0
  }
  if (start + span - tail > cap) return false;
  *vstart = start;
  return true;
}

}  // namespace dmi
