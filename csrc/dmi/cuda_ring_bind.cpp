// CUDA build of the DMI ring: memory, drain thread (copy engine into pinned staging) and bindings.
#include <cuda_runtime_api.h>

#include <atomic>
#include <stdexcept>
#include <string>

#include "bind_common.h"
#include "cuda_ring.h"
#include "router_select.h"

namespace dmi {

static void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string("DMI CUDA ring: ") + what + ": " + cudaGetErrorString(err));
}

class CudaRing : public RingCore {
 public:
  CudaRing(int device, uint64_t cap, uint64_t desc_cap, uint64_t staging_cap, int on_full, double block_timeout_s)
      : device_(device) {
    check_on_full(on_full);
    if (cap < kSlotAlign || cap % kSlotAlign) throw std::invalid_argument("ring bytes must be a positive multiple of 256");
    if (staging_cap < cap || staging_cap % kSlotAlign) throw std::invalid_argument("staging bytes must be a multiple of 256 and >= ring bytes");
    if (desc_cap < 1) throw std::invalid_argument("descriptor capacity must be >= 1");
    cap_ = cap;
    desc_cap_ = desc_cap;
    staging_cap_ = staging_cap;
    check(cudaSetDevice(device), "cudaSetDevice");
    int sms = 0;
    check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "device attribute");
    max_blocks_ = sms > 0 ? 2 * sms : 64;
    check(cudaMalloc(reinterpret_cast<void**>(&payload_), cap), "cudaMalloc(payload ring)");
    check(cudaMalloc(reinterpret_cast<void**>(&ctrl_), sizeof(DevCtrl)), "cudaMalloc(control block)");
    check(cudaMemset(ctrl_, 0, sizeof(DevCtrl)), "cudaMemset(control block)");
    int32_t one = 1;
    check(cudaMemcpy(&ctrl_->gate, &one, sizeof(one), cudaMemcpyHostToDevice), "init gate");
    void* p = nullptr;
    check(cudaHostAlloc(&p, desc_cap * sizeof(Desc), cudaHostAllocMapped), "cudaHostAlloc(descriptors)");
    descs_ = static_cast<Desc*>(p);
    std::memset(descs_, 0, desc_cap * sizeof(Desc));
    check(cudaHostAlloc(&p, sizeof(Shared), cudaHostAllocMapped), "cudaHostAlloc(shared block)");
    shared_ = static_cast<Shared*>(p);
    std::memset(shared_, 0, sizeof(Shared));
    check(cudaHostAlloc(&p, staging_cap, cudaHostAllocDefault), "cudaHostAlloc(staging)");
    staging_ = static_cast<uint8_t*>(p);
    void* dp = nullptr;
    check(cudaHostGetDevicePointer(&dp, descs_, 0), "device alias of descriptors");
    dev_.descs = static_cast<Desc*>(dp);
    check(cudaHostGetDevicePointer(&dp, shared_, 0), "device alias of shared block");
    dev_.shared = static_cast<Shared*>(dp);
    dev_.ctrl = ctrl_;
    dev_.payload = payload_;
    dev_.cap = cap;
    dev_.desc_cap = desc_cap;
    dev_.on_full = on_full;
    dev_.block_timeout_ns = static_cast<uint64_t>(block_timeout_s * 1e9);
    check(cudaStreamCreateWithFlags(&drain_stream_, cudaStreamNonBlocking), "drain stream");
    check(cudaEventCreateWithFlags(&drain_event_, cudaEventDisableTiming | cudaEventBlockingSync), "drain event");
    start_drain();
  }

  ~CudaRing() override {
    try {
      close();
    } catch (...) {
    }
    cudaSetDevice(device_);
    cudaFree(payload_);
    cudaFree(ctrl_);
    cudaFreeHost(descs_);
    cudaFreeHost(shared_);
    cudaFreeHost(staging_);
    if (drain_event_) cudaEventDestroy(drain_event_);
    if (drain_stream_) cudaStreamDestroy(drain_stream_);
  }

  void close() {
    if (closed_) return;
    closed_ = true;
    store_release(&shared_->pad0[kClosingWord], 1);  // waiting producers give up (counted as drops)
    cudaSetDevice(device_);
    cudaDeviceSynchronize();  // let in-flight producers finish before the memory can go
    stop_drain();
  }

  void publish(uintptr_t src, uint64_t nbytes, uint32_t site, uint32_t mask, uintptr_t stream,
               const std::optional<std::vector<int64_t>>& ctx) {
    if (closed_) throw std::runtime_error("ring is closed");
    if (nbytes > cap_) throw std::invalid_argument("record larger than the ring");
    CtxArg c{};
    c.use = firing_words(ctx, c.w) != nullptr;
    int ticket = static_cast<int>(ticket_.fetch_add(1) % kNumTickets);
    check(launch_publish(dev_, reinterpret_cast<const void*>(src), nbytes, site, mask, c, ticket, max_blocks_,
                         reinterpret_cast<cudaStream_t>(stream)),
          "producer launch");
  }

  // Records of one firing in one pair of launches (see cuda_ring.cu); ctx: kFiringWords words per
  // record, back to back.
  void publish_group(const std::vector<uintptr_t>& srcs, const std::vector<uint64_t>& nbytes,
                     const std::vector<uint32_t>& sites, uint32_t mask, const std::vector<int64_t>& ctx,
                     uintptr_t stream) {
    if (closed_) throw std::runtime_error("ring is closed");
    const size_t n = check_group(srcs, nbytes, sites, ctx, cap_);
    GroupArg g{};
    g.n = static_cast<int32_t>(n);
    const uint64_t first = ticket_.fetch_add(n);
    for (size_t i = 0; i < n; ++i) {
      g.src[i] = reinterpret_cast<const void*>(srcs[i]);
      g.nbytes[i] = nbytes[i];
      g.site[i] = sites[i];
      g.ticket[i] = static_cast<int32_t>((first + i) % kNumTickets);
      for (int k = 0; k < kFiringWords; ++k) g.ctx[i][k] = ctx[i * kFiringWords + k];
    }
    check(launch_publish_group(dev_, g, mask, max_blocks_, reinterpret_cast<cudaStream_t>(stream)), "group launch");
  }

  // Host -> device on the given (current) stream. The source is pageable host memory, which the
  // driver stages before cudaMemcpyAsync returns, so the stack value may go out of scope.
  void set_gate(int32_t value, uintptr_t stream) {
    check(cudaMemcpyAsync(&ctrl_->gate, &value, sizeof(value), cudaMemcpyHostToDevice,
                          reinterpret_cast<cudaStream_t>(stream)),
          "set gate");
  }

  void set_context(const std::vector<int64_t>& words, uintptr_t stream) {
    int64_t buf[kCtxWords] = {0};
    for (size_t i = 0; i < words.size() && i < static_cast<size_t>(kCtxWords); ++i) buf[i] = words[i];
    check(cudaMemcpyAsync(ctrl_->ctx, buf, sizeof(buf), cudaMemcpyHostToDevice, reinterpret_cast<cudaStream_t>(stream)),
          "set context");
  }

  // Synchronous reads for tests / doctor (never on the hot path).
  int32_t gate() {
    int32_t v = 0;
    check(cudaMemcpy(&v, &ctrl_->gate, sizeof(v), cudaMemcpyDeviceToHost), "read gate");
    return v;
  }

  std::vector<int64_t> context() {
    std::vector<int64_t> v(kCtxWords);
    check(cudaMemcpy(v.data(), ctrl_->ctx, sizeof(int64_t) * kCtxWords, cudaMemcpyDeviceToHost), "read context");
    return v;
  }

  uint8_t* payload() const { return payload_; }
  int device() const { return device_; }

 protected:
  void on_drain_thread_start() override { check(cudaSetDevice(device_), "cudaSetDevice (drain thread)"); }

  void copy_batch(const std::vector<CopyOp>& ops) override {
    for (const CopyOp& op : ops) {
      check(cudaMemcpyAsync(staging_ + op.dst_off, payload_ + op.src_off, op.nbytes, cudaMemcpyDeviceToHost, drain_stream_),
            "drain copy");
    }
    check(cudaEventRecord(drain_event_, drain_stream_), "drain event record");
    check(cudaEventSynchronize(drain_event_), "drain event sync");
  }

 private:
  int device_;
  bool closed_ = false;
  int max_blocks_ = 64;
  uint8_t* payload_ = nullptr;
  DevCtrl* ctrl_ = nullptr;
  DevRing dev_{};
  cudaStream_t drain_stream_ = nullptr;
  cudaEvent_t drain_event_ = nullptr;
  std::atomic<uint64_t> ticket_{0};
};

// Pointers and sizes come from the Python side (hooks/router.py), which checks devices, dtypes,
// contiguity and the kernel's limits before calling.
void router_select(uintptr_t probs, uintptr_t routing_map, uintptr_t pre_probs, uintptr_t pre_map, int64_t tokens,
                   int experts, int k, int dtype, uintptr_t ids, uintptr_t weights, uintptr_t counts, uintptr_t stream) {
  if (k < 1 || k > kRouterSelectMaxK || k > experts) throw std::invalid_argument("router_select: top-k out of range");
  if (experts < 1 || experts > kRouterSelectMaxExperts) throw std::invalid_argument("router_select: expert count out of range");
  if (dtype != static_cast<int>(RouterDtype::kFloat32) && dtype != static_cast<int>(RouterDtype::kBFloat16) &&
      dtype != static_cast<int>(RouterDtype::kFloat16))
    throw std::invalid_argument("router_select: unknown dtype code " + std::to_string(dtype));
  RouterSelectArgs a{reinterpret_cast<const void*>(probs), reinterpret_cast<const bool*>(routing_map),
                     reinterpret_cast<const void*>(pre_probs), reinterpret_cast<const bool*>(pre_map), tokens, experts,
                     k, static_cast<RouterDtype>(dtype), reinterpret_cast<int32_t*>(ids),
                     reinterpret_cast<void*>(weights), reinterpret_cast<int32_t*>(counts)};
  check(launch_router_select(a, reinterpret_cast<cudaStream_t>(stream)), "router_select launch");
}

}  // namespace dmi

using dmi::CudaRing;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Megatron-DMI ring, CUDA build (device payload ring, producer kernels, copy-engine drain)";
  m.def("router_select", &dmi::router_select, py::arg("probs"), py::arg("routing_map"), py::arg("pre_probs"),
        py::arg("pre_map"), py::arg("tokens"), py::arg("experts"), py::arg("k"), py::arg("dtype"), py::arg("ids"),
        py::arg("weights"), py::arg("counts"), py::arg("stream"));
  py::class_<CudaRing> cls(m, "CudaRing");
  dmi::bind_ring_common(m, cls, "cuda");
  cls
      .def(py::init<int, uint64_t, uint64_t, uint64_t, int, double>(), py::arg("device"), py::arg("ring_bytes"),
           py::arg("desc_capacity"), py::arg("staging_bytes"), py::arg("on_full_block"), py::arg("block_timeout_s"))
      .def("publish", &CudaRing::publish, py::arg("src_ptr"), py::arg("nbytes"), py::arg("site"), py::arg("mask"),
           py::arg("stream"), py::arg("ctx") = py::none())
      .def("publish_group", &CudaRing::publish_group, py::arg("src_ptrs"), py::arg("nbytes"), py::arg("sites"),
           py::arg("mask"), py::arg("ctx"), py::arg("stream"))
      .def("set_gate", &CudaRing::set_gate, py::arg("value"), py::arg("stream"))
      .def("gate", &CudaRing::gate)
      .def("set_context", &CudaRing::set_context, py::arg("words"), py::arg("stream"))
      .def("context", &CudaRing::context)
      .def("payload_dlpack",
           [](py::object self) {
             CudaRing& r = self.cast<CudaRing&>();
             return dmi::make_dlpack(self, r.payload(), static_cast<int64_t>(r.cap()), true, r.device());
           });
}
