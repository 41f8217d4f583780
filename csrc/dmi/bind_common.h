// pybind11 glue shared by the host and the CUDA builds (no torch headers: the extensions compile
// in seconds and take raw pointers / stream handles from Python).
#pragma once

#include <Python.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>  // also std::optional arguments (None)

#include <ATen/dlpack.h>

#include <algorithm>
#include <optional>
#include <cstdint>
#include <thread>
#include <vector>

#include "drain.h"
#include "spool_writer.h"

namespace py = pybind11;

namespace dmi {

// take(): (seq, site, iteration, microbatch, attempt, phase, invocation, nbytes, payload bytes).
// Waits with the GIL released; builds the bytes objects from staging, then frees staging in order.
inline py::list take_records(RingCore& core, size_t max_records, double timeout_s) {
  std::unique_lock<std::mutex> take_lock(core.take_mu(), std::defer_lock);
  std::vector<Entry> got;
  {
    py::gil_scoped_release nogil;
    take_lock.lock();
    got = core.pop_ready(max_records, timeout_s);
  }
  py::list out;
  const uint8_t* st = core.staging();
  // Allocate the bytes objects with the GIL, fill them without it (nobody else sees them yet).
  std::vector<py::object> payloads;
  payloads.reserve(got.size());
  for (const Entry& e : got) {
    PyObject* b = PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(e.d.nbytes));
    if (!b) {
      core.release_staging(got);
      throw py::error_already_set();
    }
    payloads.push_back(py::reinterpret_steal<py::object>(b));
  }
  {
    py::gil_scoped_release nogil;
    for (size_t i = 0; i < got.size(); ++i) {
      if (got[i].d.nbytes)
        std::memcpy(PyBytes_AS_STRING(payloads[i].ptr()), st + got[i].staging_off, got[i].d.nbytes);
    }
    core.release_staging(got);
  }
  for (size_t i = 0; i < got.size(); ++i) {
    const Entry& e = got[i];
    out.append(py::make_tuple(e.seq, e.d.site, e.d.iteration, e.d.microbatch, e.d.attempt, e.d.phase,
                              e.d.invocation, e.d.nbytes, payloads[i]));
  }
  return out;
}

// take_into(): the zero-copy consumer's take, one GIL-free call per batch (lingering up to the
// timeout for min_bytes, see pop_ready). Copies up to max_records finished payloads back to back into the caller's buffer (dest, dest_cap bytes),
// checksums each (zlib's CRC-32; records of a large batch are checksummed on a few threads) and
// frees their staging. Returns (rows, too_big): rows is n rows of kTakeWords uint64 words (seq,
// site, iteration, microbatch, attempt, phase, invocation, nbytes, crc32); too_big > 0 (with no
// rows) when the next record alone needs a buffer of that many bytes.
inline py::tuple take_into(RingCore& core, size_t max_records, double timeout_s, uintptr_t dest, uint64_t dest_cap,
                           uint64_t min_bytes) {
  std::vector<uint64_t> words;
  uint64_t too_big = 0;
  {
    py::gil_scoped_release nogil;
    std::vector<Entry> got;
    {
      std::lock_guard<std::mutex> take_lock(core.take_mu());
      got = core.pop_ready(max_records, timeout_s, dest_cap, &too_big, min_bytes);
      const uint8_t* st = core.staging();
      uint8_t* out = reinterpret_cast<uint8_t*>(dest);
      words.reserve(got.size() * kTakeWords);
      for (const Entry& e : got) {
        if (e.d.nbytes) std::memcpy(out, st + e.staging_off, e.d.nbytes);
        out += e.d.nbytes;
        append_take_row(e, 0, words);  // the checksum is filled in below
      }
      core.release_staging(got);
    }
    size_t n = words.size() / kTakeWords;
    std::vector<const uint8_t*> ptrs(n);
    std::vector<uint64_t> lens(n);
    const uint8_t* at = reinterpret_cast<const uint8_t*>(dest);
    for (size_t i = 0; i < n; ++i) {
      ptrs[i] = at;
      lens[i] = words[i * kTakeWords + kTakeNbytes];
      at += lens[i];
    }
    std::vector<uint32_t> crc;
    checksum_spans(ptrs, lens, crc);
    for (size_t i = 0; i < n; ++i) words[i * kTakeWords + kTakeCrc32] = crc[i];
  }
  return py::make_tuple(py::bytes(reinterpret_cast<const char*>(words.data()), words.size() * sizeof(uint64_t)),
                        too_big);
}

inline py::dict shared_stats(RingCore& core) {
  Shared* s = core.shared();
  DrainStats d = core.drain_stats();
  py::dict r;
  r["published"] = load_acquire(&s->seq);
  r["published_bytes"] = load_acquire(&s->accepted_bytes);
  r["dropped"] = load_acquire(&s->dropped);
  r["dropped_bytes"] = load_acquire(&s->dropped_bytes);
  r["rejected"] = load_acquire(&s->rejected);
  r["timeouts"] = load_acquire(&s->timeouts);
  r["blocked"] = load_acquire(&s->blocked);
  r["blocked_ns"] = load_acquire(&s->blocked_ns);
  r["head"] = load_acquire(&s->head);
  r["tail"] = load_acquire(&s->tail);
  r["desc_tail"] = load_acquire(&s->desc_tail);
  r["drained"] = d.drained;
  r["drained_bytes"] = d.drained_bytes;
  r["drain_batches"] = d.batches;
  r["drain_copies"] = d.copies;
  r["taken"] = d.taken;
  r["taken_bytes"] = d.taken_bytes;
  r["capacity"] = core.cap();
  r["desc_capacity"] = core.desc_cap();
  r["staging_capacity"] = core.staging_cap();
  r["drain_error"] = core.error();
  return r;
}

// A DLPack capsule viewing `nbytes` bytes at `data` as a 1-D uint8 tensor. The capsule keeps
// `owner` (the Python ring object) alive for as long as the tensor made from it lives.
struct DLHolder {
  int64_t shape[1];
  int64_t strides[1];
  PyObject* owner;
};

inline void dl_deleter(DLManagedTensor* self) {
  auto* h = static_cast<DLHolder*>(self->manager_ctx);
  if (h && h->owner && Py_IsInitialized()) {
    PyGILState_STATE st = PyGILState_Ensure();
    Py_DECREF(h->owner);
    PyGILState_Release(st);
  }
  delete h;
  delete self;
}

inline void dl_capsule_destructor(PyObject* cap) {
  if (PyCapsule_IsValid(cap, "dltensor")) {  // never consumed
    auto* mt = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(cap, "dltensor"));
    if (mt && mt->deleter) mt->deleter(mt);
  }
}

inline py::object make_dlpack(py::object owner, void* data, int64_t nbytes, bool cuda, int device_id) {
  auto* h = new DLHolder{{nbytes}, {1}, owner.ptr()};
  Py_INCREF(owner.ptr());
  auto* mt = new DLManagedTensor{};
  mt->dl_tensor.data = data;
  mt->dl_tensor.device.device_type = cuda ? kDLCUDA : kDLCPU;
  mt->dl_tensor.device.device_id = cuda ? device_id : 0;
  mt->dl_tensor.ndim = 1;
  mt->dl_tensor.dtype.code = kDLUInt;
  mt->dl_tensor.dtype.bits = 8;
  mt->dl_tensor.dtype.lanes = 1;
  mt->dl_tensor.shape = h->shape;
  mt->dl_tensor.strides = h->strides;
  mt->dl_tensor.byte_offset = 0;
  mt->manager_ctx = h;
  mt->deleter = dl_deleter;
  PyObject* cap = PyCapsule_New(mt, "dltensor", dl_capsule_destructor);
  if (!cap) {
    dl_deleter(mt);
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::object>(cap);
}

// The explicit context words of one record (kFiringWords of them) from a Python sequence, or
// nullptr for None (the producer then reads the context block).
inline const int64_t* firing_words(const std::optional<std::vector<int64_t>>& ctx, int64_t* words) {
  if (!ctx) return nullptr;
  const std::vector<int64_t>& v = *ctx;
  if (v.size() != static_cast<size_t>(kFiringWords))
    throw std::invalid_argument("ctx: " + std::to_string(kFiringWords) + " context words (iteration, microbatch, "
                                "attempt, phase code, invocation), not " + std::to_string(v.size()));
  std::copy(v.begin(), v.end(), words);
  return words;
}

// The arguments of publish_group, checked: 1 to kMaxGroup records, as many sizes and sites, and
// kFiringWords context words per record (one flat list).
inline size_t check_group(const std::vector<uintptr_t>& srcs, const std::vector<uint64_t>& nbytes,
                          const std::vector<uint32_t>& sites, const std::vector<int64_t>& ctx, uint64_t cap) {
  const size_t n = srcs.size();
  if (n < 1 || n > static_cast<size_t>(kMaxGroup) || nbytes.size() != n || sites.size() != n ||
      ctx.size() != n * kFiringWords)
    throw std::invalid_argument("publish_group: 1 to " + std::to_string(kMaxGroup) + " records, as many sizes and "
                                "sites, and " + std::to_string(kFiringWords) + " context words per record");
  for (uint64_t b : nbytes)
    if (b > cap) throw std::invalid_argument("record larger than the ring");
  return n;
}

// This module's C++ errors as DMI's Python errors (megatron/core/dmi/transport/base.py), so a
// caller catches them with `except DMIError`: std::invalid_argument -> TransportInputError (a
// ValueError), std::runtime_error -> NativeRingError (a RuntimeError). Module-local: both builds
// may be loaded in one process.
inline void translate_errors() {
  static py::handle input_error, ring_error;  // kept for the process's life, like the module
  py::module_ base = py::module_::import("megatron.core.dmi.transport.base");
  input_error = py::object(base.attr("TransportInputError")).release();
  ring_error = py::object(base.attr("NativeRingError")).release();
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const py::builtin_exception&) {
      throw;  // pybind11's own (a failed cast, ...): its default translation
    } catch (const std::invalid_argument& e) {
      PyErr_SetString(input_error.ptr(), e.what());
    } catch (const std::runtime_error& e) {
      PyErr_SetString(ring_error.ptr(), e.what());
    }
  });
}

// Module attributes and the bindings that are the same for both builds: every constant and code
// of ring_protocol.h, which transport/abi.py checks at load.
template <class Ring>
void bind_ring_common(py::module_& m, py::class_<Ring>& cls, const char* build) {
  translate_errors();
  m.attr("SLOT_ALIGN") = kSlotAlign;
  m.attr("CTX_WORDS") = kCtxWords;
  m.attr("FIRING_WORDS") = kFiringWords;
  m.attr("MAX_GROUP") = kMaxGroup;
  m.attr("DESC_BYTES") = sizeof(Desc);
  m.attr("TAKE_WORDS") = kTakeWords;
  py::tuple columns(kTakeWords);
  for (int i = 0; i < kTakeWords; ++i) columns[i] = py::str(kTakeColumns[i]);
  m.attr("TAKE_COLUMNS") = columns;
  py::dict on_full;
  on_full["drop"] = static_cast<int>(kDrop);
  on_full["block"] = static_cast<int>(kBlock);
  m.attr("ON_FULL") = on_full;
  py::dict results;
  results["rejected"] = static_cast<int>(kRejected);
  results["dropped"] = static_cast<int>(kDropped);
  results["accepted"] = static_cast<int>(kAccepted);
  results["timed_out"] = static_cast<int>(kTimedOut);
  m.attr("PUBLISH_RESULT") = results;
  py::dict router_dtypes;
  router_dtypes["float32"] = static_cast<int>(RouterDtype::kFloat32);
  router_dtypes["bfloat16"] = static_cast<int>(RouterDtype::kBFloat16);
  router_dtypes["float16"] = static_cast<int>(RouterDtype::kFloat16);
  m.attr("ROUTER_DTYPE") = router_dtypes;
  m.attr("ROUTER_SELECT_MAX_K") = kRouterSelectMaxK;
  m.attr("ROUTER_SELECT_MAX_EXPERTS") = kRouterSelectMaxExperts;
  m.attr("BUILD") = build;
  cls.def("take", [](Ring& r, size_t n, double timeout) { return take_records(r, n, timeout); })
      .def(
          "take_into",
          [](Ring& r, size_t n, double timeout, uintptr_t dest, uint64_t cap, uint64_t min_bytes) {
            return take_into(r, n, timeout, dest, cap, min_bytes);
          },
          py::arg("max_records"), py::arg("timeout"), py::arg("dest"), py::arg("dest_cap"), py::arg("min_bytes") = 0)
      .def("sync",
           [](Ring& r, double timeout) {
             py::gil_scoped_release nogil;
             return r.sync(timeout);
           })
      .def("stats", [](Ring& r) { return shared_stats(r); })
      .def("close", [](Ring& r) {
        py::gil_scoped_release nogil;
        r.close();
      });
  // The native spool writer of a ring (spool_writer.h); keeps the ring object alive. Module-local:
  // both builds bind this one C++ type, and a process may load both (pybind11's registry is global).
  py::class_<SpoolThread>(m, "SpoolThread", py::module_local())
      .def(py::init([](Ring& r, std::string dir, std::string header_json, uint64_t first_seq, uint64_t segment_bytes,
                       uint64_t linger_bytes, double poll_s, double segment_seconds) {
             return new SpoolThread(r, SpoolConfig{std::move(dir), std::move(header_json), first_seq, segment_bytes,
                                                   linger_bytes, poll_s, segment_seconds});
           }),
           py::keep_alive<1, 2>(), py::arg("ring"), py::arg("dir"), py::arg("header_json"), py::arg("first_seq"),
           py::arg("segment_bytes"), py::arg("linger_bytes"), py::arg("poll_s"), py::arg("segment_seconds"))
      .def("add_site", &SpoolThread::add_site)
      .def("flush", &SpoolThread::flush, py::call_guard<py::gil_scoped_release>())
      .def("stop", &SpoolThread::stop, py::call_guard<py::gil_scoped_release>())
      .def("set_hold", &SpoolThread::set_hold, py::arg("hold"))
      .def("take_closed", &SpoolThread::take_closed)
      .def("stats", [](SpoolThread& t) {
        SpoolStats s = t.stats();
        py::dict d;
        d["records"] = s.records;
        d["bytes"] = s.bytes;
        d["dropped_records"] = s.dropped_records;
        d["dropped_bytes"] = s.dropped_bytes;
        d["segments"] = s.segments;
        d["open_rows"] = s.open_rows;
        d["open_bytes"] = s.open_bytes;
        d["checksum_ns"] = s.checksum_ns;
        d["write_ns"] = s.write_ns;
        d["sync_ns"] = s.sync_ns;
        d["errors"] = s.errors;
        return d;
      });
}

}  // namespace dmi
