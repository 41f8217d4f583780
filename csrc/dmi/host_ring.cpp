// Host build of the DMI ring: the same protocol as the CUDA build (ring_protocol.h, drain.h) with
// the payload ring in host memory and the producer running on the calling thread. It serves CPU
// tensors and lets CI test the protocol (wrap-around, full ring in block and drop mode, zero-byte
// records, the gate, descriptor keys) on a machine without a GPU.
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>

#include "bind_common.h"

namespace dmi {

template <typename T>
static T* alloc_zeroed(uint64_t bytes) {
  uint64_t n = align_up(bytes ? bytes : 1, kSlotAlign);
  void* p = std::aligned_alloc(kSlotAlign, n);
  if (!p) throw std::bad_alloc();
  std::memset(p, 0, n);
  return static_cast<T*>(p);
}

static uint64_t load_relaxed(const uint64_t* p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }

// A producer keeps the GIL for a small copy: handing it over costs more than the copy whenever
// another Python thread (the consumer) wants it, as that thread then runs for up to the
// interpreter's switch interval before the producer gets it back. It gives the GIL up only to
// wait (for the producer lock or for ring space, which the consumer may have to free) or to copy
// at least kReleaseGilBytes, and takes it back when destroyed: declared before the producer
// lock, so after that lock is released (never waiting for the GIL while holding it).
constexpr uint64_t kReleaseGilBytes = 1 << 20;

namespace {  // pybind11's types are hidden: so is this holder of one
class GilRelease {
 public:
  void release() {
    if (!released_) released_.emplace();
  }

 private:
  std::optional<py::gil_scoped_release> released_;
};
}  // namespace
static void bump(uint64_t* p, uint64_t v) { store_release(p, load_relaxed(p) + v); }

class HostRing : public RingCore {
 public:
  HostRing(uint64_t cap, uint64_t desc_cap, uint64_t staging_cap, int on_full, double block_timeout_s)
      : on_full_(on_full), block_timeout_s_(block_timeout_s) {
    check_on_full(on_full);
    if (cap < kSlotAlign || cap % kSlotAlign) throw std::invalid_argument("ring bytes must be a positive multiple of 256");
    if (staging_cap < cap || staging_cap % kSlotAlign) throw std::invalid_argument("staging bytes must be a multiple of 256 and >= ring bytes");
    if (desc_cap < 1) throw std::invalid_argument("descriptor capacity must be >= 1");
    cap_ = cap;
    desc_cap_ = desc_cap;
    staging_cap_ = staging_cap;
    payload_ = alloc_zeroed<uint8_t>(cap);
    descs_ = alloc_zeroed<Desc>(desc_cap * sizeof(Desc));
    shared_ = alloc_zeroed<Shared>(sizeof(Shared));
    staging_ = alloc_zeroed<uint8_t>(staging_cap);
    for (auto& w : ctx_) w = 0;
    start_drain();
  }

  ~HostRing() override {
    close();
    std::free(payload_);
    std::free(descs_);
    std::free(shared_);
    std::free(staging_);
  }

  void close() {
    if (!closed_) {
      closed_ = true;
      stop_drain();
    }
  }

  // Producer: copy nbytes at src into the ring under `site`. Runs on the caller's thread, which
  // holds the GIL (see GilRelease).
  // `ctx` (optional, kCtxWords words): explicit context words for this record instead of the
  // context block (the eager `publish(key, tensor)` path: atomic with the reservation).
  int publish(uintptr_t src, uint64_t nbytes, uint32_t site, uint32_t mask, const int64_t* ctx = nullptr) {
    if (closed_) throw std::runtime_error("ring is closed");
    if (nbytes > cap_) throw std::invalid_argument("record larger than the ring");
    const int32_t gate = gate_.load(std::memory_order_acquire);
    GilRelease nogil;
    std::unique_lock<std::mutex> lk(prod_mu_, std::try_to_lock);
    if (!lk.owns_lock()) {
      nogil.release();
      lk.lock();
    }
    if ((static_cast<uint32_t>(gate) & mask) == 0) {  // rejected: nothing published or consumed
      bump(&shared_->rejected, 1);
      return kRejected;
    }
    const uint64_t span = align_up(nbytes, kSlotAlign);
    uint64_t vstart = 0;
    auto t0 = std::chrono::steady_clock::now();
    bool waited = false;
    // Counted on every way out of the wait: the producer's thread stood still this long.
    auto count_wait = [&] {
      if (!waited) return;
      bump(&shared_->blocked, 1);
      bump(&shared_->blocked_ns, static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                                            std::chrono::steady_clock::now() - t0).count()));
    };
    for (;;) {
      uint64_t tail = load_acquire(&shared_->tail);
      uint64_t dtail = load_acquire(&shared_->desc_tail);
      if (plan_slot(head_, tail, span, cap_, &vstart) && seq_ - dtail < desc_cap_) break;
      if (on_full_ == kDrop) {
        bump(&shared_->dropped, 1);
        bump(&shared_->dropped_bytes, nbytes);
        return kDropped;
      }
      waited = true;
      nogil.release();
      if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() > block_timeout_s_) {
        count_wait();
        bump(&shared_->dropped, 1);
        bump(&shared_->dropped_bytes, nbytes);
        bump(&shared_->timeouts, 1);
        return kTimedOut;
      }
      kick();
      std::unique_lock<std::mutex> sl(space_mu_);
      space_cv_.wait_for(sl, std::chrono::microseconds(200));
    }
    count_wait();
    const uint64_t seq = seq_++;
    head_ = vstart + span;
    const uint64_t off = vstart % cap_;
    if (nbytes >= kReleaseGilBytes) nogil.release();
    if (nbytes) std::memcpy(payload_ + off, reinterpret_cast<const void*>(src), nbytes);
    Desc* d = &descs_[seq % desc_cap_];
    const int64_t* c = ctx ? ctx : ctx_;
    d->offset = off;
    d->nbytes = nbytes;
    d->vend = head_;
    d->iteration = c[kCtxIteration];
    d->microbatch = static_cast<int32_t>(c[kCtxMicrobatch]);
    d->attempt = static_cast<int32_t>(c[kCtxAttempt]);
    d->phase = static_cast<int32_t>(c[kCtxPhase]);
    d->invocation = static_cast<int32_t>(c[kCtxInvocation]);
    d->site = site;
    d->flags = 0;
    store_release(&d->ready, seq + 1);  // publish: everything above is visible before this
    store_release(&shared_->head, head_);
    bump(&shared_->accepted_bytes, nbytes);
    store_release(&shared_->seq, seq_);
    lk.unlock();
    kick();
    return kAccepted;
  }

  // The records of one hook firing in one call: each reserved and copied in order (`ctx`: the
  // firing words of every record, back to back). Returns one PublishResult per record.
  std::vector<int> publish_group(const std::vector<uintptr_t>& srcs, const std::vector<uint64_t>& nbytes,
                                 const std::vector<uint32_t>& sites, uint32_t mask, const std::vector<int64_t>& ctx) {
    const size_t n = check_group(srcs, nbytes, sites, ctx, cap_);
    std::vector<int> out(n);
    for (size_t i = 0; i < n; ++i) out[i] = publish(srcs[i], nbytes[i], sites[i], mask, ctx.data() + i * kFiringWords);
    return out;
  }

  void set_gate(int32_t value) { gate_.store(value, std::memory_order_release); }
  int32_t gate() const { return gate_.load(std::memory_order_acquire); }

  void set_context(const std::vector<int64_t>& words) {
    std::lock_guard<std::mutex> g(prod_mu_);
    for (size_t i = 0; i < words.size() && i < static_cast<size_t>(kCtxWords); ++i) ctx_[i] = words[i];
  }

  std::vector<int64_t> context() {
    std::lock_guard<std::mutex> g(prod_mu_);
    return std::vector<int64_t>(ctx_, ctx_ + kCtxWords);
  }

  uint8_t* payload() const { return payload_; }

 protected:
  void copy_batch(const std::vector<CopyOp>& ops) override {
    for (const CopyOp& op : ops) std::memcpy(staging_ + op.dst_off, payload_ + op.src_off, op.nbytes);
  }
  void on_space_freed() override { space_cv_.notify_all(); }

 private:
  int on_full_;
  double block_timeout_s_;
  bool closed_ = false;
  uint8_t* payload_ = nullptr;
  std::atomic<int32_t> gate_{1};
  std::mutex prod_mu_;  // producer lock: reservation order == sequence order
  uint64_t head_ = 0;
  uint64_t seq_ = 0;
  int64_t ctx_[kCtxWords];
  std::mutex space_mu_;
  std::condition_variable space_cv_;
};

}  // namespace dmi

using dmi::HostRing;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Megatron-DMI ring, host build (CPU tensors)";
  py::class_<HostRing> cls(m, "HostRing");
  dmi::bind_ring_common(m, cls, "host");
  cls
      .def(py::init<uint64_t, uint64_t, uint64_t, int, double>(), py::arg("ring_bytes"), py::arg("desc_capacity"),
           py::arg("staging_bytes"), py::arg("on_full_block"), py::arg("block_timeout_s"))
      .def("publish",
           [](HostRing& r, uintptr_t src, uint64_t nbytes, uint32_t site, uint32_t mask,
              const std::optional<std::vector<int64_t>>& ctx) {
             int64_t words[dmi::kFiringWords];
             return r.publish(src, nbytes, site, mask, dmi::firing_words(ctx, words));
           },
           py::arg("src_ptr"), py::arg("nbytes"), py::arg("site"), py::arg("mask") = 1, py::arg("ctx") = py::none())
      .def("publish_group", &HostRing::publish_group, py::arg("src_ptrs"),
           py::arg("nbytes"), py::arg("sites"), py::arg("mask"), py::arg("ctx"))
      .def("set_gate", &HostRing::set_gate)
      .def("gate", &HostRing::gate)
      .def("set_context", &HostRing::set_context, py::call_guard<py::gil_scoped_release>())
      .def("context", &HostRing::context, py::call_guard<py::gil_scoped_release>())
      .def("payload_dlpack",
           [](py::object self) {
             HostRing& r = self.cast<HostRing&>();
             return dmi::make_dlpack(self, r.payload(), static_cast<int64_t>(r.cap()), false, 0);
           });
}
