// Host drain shared by the host build and the CUDA build.
//
// One C++ thread per ring. It discovers published descriptors in sequence order (the `ready` word
// of Desc), reserves space for their payloads in a pinned host staging ring, copies the filled
// spans out in one batch (memcpy in the host build; cudaMemcpyAsync on the drain's own
// non-blocking stream in the CUDA build: copy engine, no SM writes to host memory), waits for the
// batch, then frees the payload/descriptor ring space in order (`Shared::tail`, `desc_tail`) and
// queues the records for `take`. `take` hands (descriptor, bytes) to Python and frees the staging
// space in order.
//
// Freeing ring space needs only this thread and the copy engine: no Python, no GIL, no kernel
// launch, no device synchronisation. That is what keeps a full ring (and a producer spinning on
// it in block mode) from deadlocking the drain. See the comment on block mode in cuda_ring.cu.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "ring_protocol.h"

namespace dmi {

inline uint64_t load_acquire(const uint64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
inline void store_release(uint64_t* p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

struct CopyOp {
  uint64_t src_off;  // physical offset in the payload ring
  uint64_t dst_off;  // physical offset in the staging ring
  uint64_t nbytes;
};

struct Entry {
  Desc d;
  uint64_t seq;
  uint64_t staging_off;   // physical offset in the staging ring
  uint64_t staging_vend;  // staging tail after this entry is taken
};

// The record's take row (TakeColumn order) appended to `words`.
inline void append_take_row(const Entry& e, uint32_t crc32, std::vector<uint64_t>& words) {
  uint64_t row[kTakeWords];
  row[kTakeSeq] = e.seq;
  row[kTakeSite] = e.d.site;
  row[kTakeIteration] = static_cast<uint64_t>(e.d.iteration);
  row[kTakeMicrobatch] = static_cast<uint64_t>(e.d.microbatch);
  row[kTakeAttempt] = static_cast<uint64_t>(e.d.attempt);
  row[kTakePhase] = static_cast<uint64_t>(e.d.phase);
  row[kTakeInvocation] = static_cast<uint64_t>(e.d.invocation);
  row[kTakeNbytes] = e.d.nbytes;
  row[kTakeCrc32] = crc32;
  words.insert(words.end(), row, row + kTakeWords);
}

struct DrainStats {
  uint64_t drained = 0;
  uint64_t drained_bytes = 0;
  uint64_t batches = 0;
  uint64_t copies = 0;
  uint64_t taken = 0;
  uint64_t taken_bytes = 0;
};

// The part of a ring both builds share: descriptor/shared memory pointers, staging ring, drain
// thread and ready queue. A subclass provides the memory and `copy_batch`.
class RingCore {
 public:
  virtual ~RingCore() = default;

  uint64_t cap() const { return cap_; }
  uint64_t desc_cap() const { return desc_cap_; }
  uint64_t staging_cap() const { return staging_cap_; }
  Shared* shared() const { return shared_; }

  void start_drain() {
    stop_.store(false);
    thread_ = std::thread([this] { this->run(); });
  }

  void stop_drain() {
    {
      std::lock_guard<std::mutex> g(drain_mu_);
      stop_.store(true);
    }
    drain_cv_.notify_all();
    ready_cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

  void kick() { drain_cv_.notify_one(); }

  // Wait (up to timeout_s) until the drain thread has completed one full pass that started after
  // this call and found nothing more it could move (nothing published, or staging full).
  bool sync(double timeout_s) {
    uint64_t req;
    {
      std::lock_guard<std::mutex> g(drain_mu_);
      req = ++sync_req_;
    }
    drain_cv_.notify_all();
    std::unique_lock<std::mutex> lk(drain_mu_);
    return sync_cv_.wait_for(lk, std::chrono::duration<double>(timeout_s),
                             [&] { return sync_ack_ >= req || stop_.load(); });
  }

  // Pop up to max_records finished entries holding at most max_bytes of payload. Waits up to
  // timeout_s until at least min_bytes of payload (or max_records entries, or max_bytes) are ready,
  // then pops whatever is ready (possibly less after a timeout): lingering lets a trickle of small
  // records leave in one batch instead of one Python round trip each. When the first entry alone
  // exceeds max_bytes nothing is popped and its size is stored in *too_big. The caller must hold
  // take_mu() across pop_ready + reading the staging bytes + release_staging.
  std::vector<Entry> pop_ready(size_t max_records, double timeout_s, uint64_t max_bytes = UINT64_MAX,
                               uint64_t* too_big = nullptr, uint64_t min_bytes = 0,
                               const uint64_t* since_epoch = nullptr) {
    std::vector<Entry> out;
    std::unique_lock<std::mutex> lk(ready_mu_);
    const uint64_t enough = std::max<uint64_t>(1, std::min(min_bytes, max_bytes));
    const uint64_t epoch = since_epoch ? *since_epoch : wake_epoch_;
    auto ready_enough = [&] {
      return stop_.load() || wake_epoch_ != epoch ||
             (!ready_.empty() && (ready_bytes_ >= enough || ready_.size() >= max_records || (min_bytes == 0)));
    };
    if (!ready_enough() && timeout_s > 0) {
      ready_cv_.wait_for(lk, std::chrono::duration<double>(timeout_s), ready_enough);
    }
    uint64_t bytes = 0;
    while (!ready_.empty() && out.size() < max_records) {
      uint64_t n = ready_.front().d.nbytes;
      if (bytes + n > max_bytes) {
        if (out.empty() && too_big) *too_big = n;
        break;
      }
      bytes += n;
      out.push_back(ready_.front());
      ready_.pop_front();
    }
    ready_bytes_ -= bytes;
    return out;
  }

  // End every wait in pop_ready now (it returns what is ready, possibly nothing): a flush must not
  // wait out a linger. A taker that reads wake_epoch() before deciding how long to wait and passes
  // it to pop_ready misses no wake-up in between.
  uint64_t wake_epoch() {
    std::lock_guard<std::mutex> g(ready_mu_);
    return wake_epoch_;
  }

  void wake_takers() {
    {
      std::lock_guard<std::mutex> g(ready_mu_);
      ++wake_epoch_;
    }
    ready_cv_.notify_all();
  }

  void release_staging(const std::vector<Entry>& taken) {
    if (taken.empty()) return;
    uint64_t bytes = 0;
    for (auto& e : taken) bytes += e.d.nbytes;
    {
      std::lock_guard<std::mutex> g(drain_mu_);
      staging_tail_ = taken.back().staging_vend;
      stats_.taken += taken.size();
      stats_.taken_bytes += bytes;
    }
    drain_cv_.notify_all();
  }

  std::mutex& take_mu() { return take_mu_; }
  const uint8_t* staging() const { return staging_; }

  DrainStats drain_stats() {
    std::lock_guard<std::mutex> g(drain_mu_);
    return stats_;
  }

  uint64_t taken() {
    std::lock_guard<std::mutex> g(drain_mu_);
    return stats_.taken;
  }

  std::string error() {
    std::lock_guard<std::mutex> g(drain_mu_);
    return error_;
  }

 protected:
  // Copy every op from the payload ring into the staging ring and return once the bytes are in
  // staging. Runs on the drain thread.
  virtual void copy_batch(const std::vector<CopyOp>& ops) = 0;
  virtual void on_drain_thread_start() {}
  // Called after ring space was freed (host build wakes blocked producers).
  virtual void on_space_freed() {}

  uint64_t cap_ = 0;
  uint64_t desc_cap_ = 0;
  uint64_t staging_cap_ = 0;
  Desc* descs_ = nullptr;      // host-readable descriptor ring
  Shared* shared_ = nullptr;   // host-readable/writable shared block
  uint8_t* staging_ = nullptr; // host staging ring (pinned in the CUDA build)

 private:
  void run() {
    try {
      on_drain_thread_start();
      loop();
    } catch (const std::exception& ex) {
      std::lock_guard<std::mutex> g(drain_mu_);
      error_ = ex.what();
    }
    // Never leave a waiter hanging if the thread dies.
    ready_cv_.notify_all();
    sync_cv_.notify_all();
  }

  void loop() {
    const size_t kMaxBatchRecords = 1024;
    const uint64_t kMaxBatchBytes = 256ull << 20;
    std::vector<Entry> batch;
    std::vector<CopyOp> ops;
    uint64_t next = 0;       // next sequence number to drain
    uint64_t st_head = 0;    // staging reservation position (virtual)
    int idle_spins = 0;
    while (!stop_.load(std::memory_order_relaxed)) {
      uint64_t req_seen;
      uint64_t st_tail;
      {
        std::lock_guard<std::mutex> g(drain_mu_);
        req_seen = sync_req_;
        st_tail = staging_tail_;
      }
      batch.clear();
      ops.clear();
      uint64_t batch_bytes = 0;
      uint64_t src_end = UINT64_MAX, dst_end = UINT64_MAX;
      while (batch.size() < kMaxBatchRecords && batch_bytes < kMaxBatchBytes) {
        const Desc* slot = &descs_[next % desc_cap_];
        if (load_acquire(&slot->ready) != next + 1) break;
        Entry e;
        std::memcpy(&e.d, slot, sizeof(Desc));
        e.seq = next;
        uint64_t span = align_up(e.d.nbytes, kSlotAlign);
        uint64_t svstart;
        if (!plan_slot(st_head, st_tail, span, staging_cap_, &svstart)) break;  // staging full
        st_head = svstart + span;
        e.staging_off = svstart % staging_cap_;
        e.staging_vend = st_head;
        if (e.d.nbytes > 0) {
          if (!ops.empty() && e.d.offset == src_end && e.staging_off == dst_end) {
            ops.back().nbytes = e.d.offset + e.d.nbytes - ops.back().src_off;  // merge adjacent spans
          } else {
            ops.push_back(CopyOp{e.d.offset, e.staging_off, e.d.nbytes});
          }
          src_end = e.d.offset + span;
          dst_end = e.staging_off + span;
        }
        batch_bytes += e.d.nbytes;
        batch.push_back(e);
        ++next;
      }
      if (batch.empty()) {
        std::unique_lock<std::mutex> lk(drain_mu_);
        if (sync_ack_ < req_seen) {
          sync_ack_ = req_seen;
          sync_cv_.notify_all();
        }
        if (sync_req_ != req_seen) continue;  // a new sync request arrived: do another pass
        // Idle back-off: a few yields, then sleeps growing to 1 ms (producers of the host build and
        // take() kick the condition variable; the CUDA build's producers are found by polling).
        ++idle_spins;
        if (idle_spins < 32) {
          lk.unlock();
          std::this_thread::yield();
        } else {
          int shift = idle_spins - 32 < 5 ? idle_spins - 32 : 5;
          drain_cv_.wait_for(lk, std::chrono::microseconds(32 << shift));
        }
        continue;
      }
      idle_spins = 0;
      if (!ops.empty()) copy_batch(ops);
      // The bytes are in staging: free the ring space in order.
      store_release(&shared_->tail, batch.back().d.vend);
      store_release(&shared_->desc_tail, next);
      on_space_freed();
      {
        std::lock_guard<std::mutex> g(ready_mu_);
        for (auto& e : batch) ready_.push_back(e);
        ready_bytes_ += batch_bytes;
      }
      ready_cv_.notify_all();
      {
        std::lock_guard<std::mutex> g(drain_mu_);
        stats_.drained += batch.size();
        stats_.drained_bytes += batch_bytes;
        stats_.batches += 1;
        stats_.copies += ops.size();
      }
    }
  }

  std::thread thread_;
  std::atomic<bool> stop_{true};
  std::mutex drain_mu_;  // guards staging_tail_, sync_*, stats_, error_
  std::condition_variable drain_cv_;
  std::condition_variable sync_cv_;
  uint64_t staging_tail_ = 0;
  uint64_t sync_req_ = 0;
  uint64_t sync_ack_ = 0;
  DrainStats stats_;
  std::string error_;

  std::mutex ready_mu_;
  std::condition_variable ready_cv_;
  std::deque<Entry> ready_;
  uint64_t ready_bytes_ = 0;  // payload bytes in ready_ (guarded by ready_mu_)
  uint64_t wake_epoch_ = 0;   // bumped by wake_takers (guarded by ready_mu_)

  std::mutex take_mu_;
};

}  // namespace dmi
