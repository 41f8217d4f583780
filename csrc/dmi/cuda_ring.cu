// DMI producer kernels (CUDA build).
//
// One publish = two kernels on the caller's (current) stream, both graph-capturable (a group of up to
// kMaxGroup records, e.g. every output of one router firing, also takes two: dmi_reserve_group
// reserves them in order under one lock, dmi_copy_group copies them with one grid row per record):
//   1. dmi_reserve<<<1, 32>>>: reads the int32 device gate; a rejection publishes nothing and
//      consumes nothing (it only counts `rejected`). Otherwise, under a device spin lock, it reserves
//      a contiguous 256-byte-aligned slot in the payload ring and the next sequence number with
//      device-side state only (no host involvement, so it works inside CUDA graph replays), writes
//      the descriptor's key fields (site id + the context block words) and fills a ticket.
//   2. dmi_copy_publish<<<grid, 256>>>: vectorised copy of the tensor bytes into the slot; the
//      last block to finish fences (system scope) and stores the descriptor's `ready` word.
// A zero-byte record goes through both and publishes a descriptor with nbytes = 0.
//
// Backpressure (on_full):
//   * drop: no space -> count `dropped` / `dropped_bytes` and publish nothing.
//   * block: the reserve thread polls the drain's `tail` words (mapped host memory, read with
//     ld.acquire.sys) with __nanosleep until the record fits; the wait is counted (`blocked`,
//     `blocked_ns`), since it stalls the training stream.
// Why block cannot deadlock the drain: freeing ring space depends only on the host drain thread
// and the copy engine. The drain discovers descriptors in mapped host memory (no device sync, no
// kernel), copies on its own non-blocking stream (no dependency on the producer's stream or the
// legacy default stream; copy engine, no SMs), and frees space by a plain store to mapped host
// memory (no kernel launch, so a GPU full of waiting work cannot starve it). A waiting producer
// holds only the producer lock, which the drain never takes, and every record ahead of it in the
// ring was already fully reserved and is being copied by a kernel that waits for nothing. The
// remaining dependency is on the consumer taking records out of the host staging ring; that is
// bounded by `block_timeout_ns` (the record is then dropped and counted in `timeouts` as well as
// `dropped`: never lost silently, never a hung training job), and `close()` sets a closing word
// that makes waiting producers give up at once.
#include <cuda_runtime.h>

#include "cuda_ring.h"

namespace dmi {

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void st_volatile(uint64_t* p, uint64_t v) { *reinterpret_cast<volatile uint64_t*>(p) = v; }

__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// One reservation; the caller holds the producer lock. `ctx` = nullptr: the device context block.
__device__ void reserve_locked(const DevRing& r, uint64_t nbytes, uint32_t site, uint32_t mask, const int64_t* ctx,
                               int ticket) {
  volatile DevCtrl* vc = r.ctrl;
  volatile Ticket* t = &r.ctrl->tickets[ticket];
  const int32_t gate = vc->gate;
  if ((static_cast<uint32_t>(gate) & mask) == 0) {
    uint64_t n = vc->rejected + 1;
    vc->rejected = n;
    st_volatile(&r.shared->rejected, n);
    t->accepted = 0;
  } else {
    const uint64_t span = align_up(nbytes, kSlotAlign);
    uint64_t vstart = 0;
    bool ok = false, timed_out = false;
    uint64_t t0 = 0;
    for (int iter = 0;; ++iter) {
      uint64_t tail = ld_acquire_sys(&r.shared->tail);
      uint64_t dtail = ld_acquire_sys(&r.shared->desc_tail);
      if (plan_slot(vc->head, tail, span, r.cap, &vstart) && vc->seq - dtail < r.desc_cap) {
        ok = true;
        break;
      }
      if (r.on_full != kBlock || ld_acquire_sys(&r.shared->pad0[kClosingWord]) != 0) break;
      uint64_t now = globaltimer_ns();
      if (iter == 0) t0 = now;
      if (now - t0 > r.block_timeout_ns) {
        timed_out = true;
        break;
      }
      __nanosleep(iter < 64 ? 256 : 4000);
    }
    if (t0 != 0) {  // waited for space: the training stream stood still this long
      vc->blocked = vc->blocked + 1;
      vc->blocked_ns = vc->blocked_ns + (globaltimer_ns() - t0);
      st_volatile(&r.shared->blocked, vc->blocked);
      st_volatile(&r.shared->blocked_ns, vc->blocked_ns);
    }
    if (ok) {
      const uint64_t seq = vc->seq;
      const uint64_t head = vstart + span;
      vc->seq = seq + 1;
      vc->head = head;
      vc->accepted_bytes = vc->accepted_bytes + nbytes;
      volatile Desc* d = &r.descs[seq % r.desc_cap];
      d->offset = vstart % r.cap;
      d->nbytes = nbytes;
      d->vend = head;
      int64_t w[kFiringWords];
      for (int k = 0; k < kFiringWords; ++k) w[k] = ctx ? ctx[k] : vc->ctx[k];
      d->iteration = w[kCtxIteration];
      d->microbatch = static_cast<int32_t>(w[kCtxMicrobatch]);
      d->attempt = static_cast<int32_t>(w[kCtxAttempt]);
      d->phase = static_cast<int32_t>(w[kCtxPhase]);
      d->invocation = static_cast<int32_t>(w[kCtxInvocation]);
      d->site = site;
      d->flags = 0;
      t->offset = vstart % r.cap;
      t->seq = seq;
      t->done = 0;
      t->accepted = 1;
      st_volatile(&r.shared->head, head);
      st_volatile(&r.shared->accepted_bytes, vc->accepted_bytes);
      st_volatile(&r.shared->seq, seq + 1);
    } else {
      vc->dropped = vc->dropped + 1;
      vc->dropped_bytes = vc->dropped_bytes + nbytes;
      st_volatile(&r.shared->dropped, vc->dropped);
      st_volatile(&r.shared->dropped_bytes, vc->dropped_bytes);
      if (timed_out) {
        vc->timeouts = vc->timeouts + 1;
        st_volatile(&r.shared->timeouts, vc->timeouts);
      }
      t->accepted = 0;
    }
  }
}

__device__ __forceinline__ void lock_producers(DevCtrl* c) {
  while (atomicCAS(&c->lock, 0, 1) != 0) __nanosleep(64);
  __threadfence();
}

__device__ __forceinline__ void unlock_producers(DevCtrl* c) {
  __threadfence_system();
  atomicExch(&c->lock, 0);
}

__global__ void dmi_reserve(DevRing r, uint64_t nbytes, uint32_t site, uint32_t mask, CtxArg ctx, int ticket) {
  if (threadIdx.x != 0) return;
  lock_producers(r.ctrl);
  reserve_locked(r, nbytes, site, mask, ctx.use ? ctx.w : nullptr, ticket);
  unlock_producers(r.ctrl);
}

// A group's records are reserved under one lock, in order: consecutive sequence numbers.
__global__ void dmi_reserve_group(DevRing r, GroupArg g, uint32_t mask) {
  if (threadIdx.x != 0) return;
  lock_producers(r.ctrl);
  for (int i = 0; i < g.n; ++i) reserve_locked(r, g.nbytes[i], g.site[i], mask, g.ctx[i], g.ticket[i]);
  unlock_producers(r.ctrl);
}

template <typename V>
__device__ __forceinline__ void copy_vec(uint8_t* __restrict__ dst, const uint8_t* __restrict__ src, uint64_t nbytes,
                                         uint64_t tid, uint64_t stride) {
  const uint64_t n = nbytes / sizeof(V);
  const V* s = reinterpret_cast<const V*>(src);
  V* d = reinterpret_cast<V*>(dst);
  uint64_t i = tid;
  // 4 independent loads in flight per thread
  for (; i + 3 * stride < n; i += 4 * stride) {
    V a = s[i], b = s[i + stride], e = s[i + 2 * stride], f = s[i + 3 * stride];
    d[i] = a;
    d[i + stride] = b;
    d[i + 2 * stride] = e;
    d[i + 3 * stride] = f;
  }
  for (; i < n; i += stride) d[i] = s[i];
  for (uint64_t j = n * sizeof(V) + tid; j < nbytes; j += stride) dst[j] = src[j];
}

// This block's share of one record's copy (gridDim.x blocks per record); the last block of the
// record to finish publishes its descriptor.
__device__ void copy_one(const DevRing& r, const uint8_t* __restrict__ src, uint64_t nbytes, int ticket) {
  volatile Ticket* t = &r.ctrl->tickets[ticket];
  if (t->accepted == 0) return;  // rejected or dropped: nothing to copy, nothing to publish
  uint8_t* dst = r.payload + t->offset;
  const uint64_t tid = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  const uintptr_t a = reinterpret_cast<uintptr_t>(src);  // dst is 256-byte aligned
  if ((a & 15) == 0) {
    copy_vec<uint4>(dst, src, nbytes, tid, stride);
  } else if ((a & 7) == 0) {
    copy_vec<uint2>(dst, src, nbytes, tid, stride);
  } else if ((a & 3) == 0) {
    copy_vec<uint32_t>(dst, src, nbytes, tid, stride);
  } else {
    copy_vec<uint8_t>(dst, src, nbytes, tid, stride);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();  // this block's bytes are visible before it is counted
    unsigned prev = atomicAdd(const_cast<uint32_t*>(&t->done), 1u);
    if (prev == gridDim.x - 1) {
      __threadfence_system();
      const uint64_t seq = t->seq;
      st_release_sys(&r.descs[seq % r.desc_cap].ready, seq + 1);
    }
  }
}

__global__ void dmi_copy_publish(DevRing r, const uint8_t* __restrict__ src, uint64_t nbytes, int ticket) {
  copy_one(r, src, nbytes, ticket);
}

__global__ void dmi_copy_group(DevRing r, GroupArg g) {  // blockIdx.y: the record
  const int i = blockIdx.y;
  copy_one(r, static_cast<const uint8_t*>(g.src[i]), g.nbytes[i], g.ticket[i]);
}

static unsigned copy_blocks(uint64_t nbytes, int max_blocks) {
  const uint64_t per_block = 256ull * 16 * 4;
  uint64_t blocks = (nbytes + per_block - 1) / per_block;
  if (blocks < 1) blocks = 1;
  if (blocks > static_cast<uint64_t>(max_blocks)) blocks = max_blocks;
  return static_cast<unsigned>(blocks);
}

cudaError_t launch_publish(const DevRing& r, const void* src, uint64_t nbytes, uint32_t site, uint32_t mask,
                           const CtxArg& ctx, int ticket, int max_blocks, cudaStream_t stream) {
  dmi_reserve<<<1, 32, 0, stream>>>(r, nbytes, site, mask, ctx, ticket);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  dmi_copy_publish<<<copy_blocks(nbytes, max_blocks), 256, 0, stream>>>(r, static_cast<const uint8_t*>(src), nbytes,
                                                                         ticket);
  return cudaGetLastError();
}

cudaError_t launch_publish_group(const DevRing& r, const GroupArg& g, uint32_t mask, int max_blocks,
                                 cudaStream_t stream) {
  if (g.n < 1 || g.n > kMaxGroup) return cudaErrorInvalidValue;
  dmi_reserve_group<<<1, 32, 0, stream>>>(r, g, mask);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  uint64_t largest = 0;
  for (int i = 0; i < g.n; ++i) largest = g.nbytes[i] > largest ? g.nbytes[i] : largest;
  const unsigned per_record = copy_blocks(largest, max_blocks / g.n > 0 ? max_blocks / g.n : 1);
  dmi_copy_group<<<dim3(per_record, static_cast<unsigned>(g.n)), 256, 0, stream>>>(r, g);
  return cudaGetLastError();
}

}  // namespace dmi
