// proto._stream_ops: the CUDA driver calls of a same-GPU call, each queued on a stream for a
// fraction of a microsecond of host time (through ctypes a driver call costs ~3.5 us, and a
// torch copy_ or clone ~10 us: benchmarks/RESULTS.md, "S6 pieces").
//
//   copy(dst, src, nbytes, stream, device) cuMemcpyAsync between two device (or mapped) addresses;
//                                         in a thread with no current CUDA context (one that has
//                                         made no CUDA runtime call yet) it first makes `device`'s
//                                         primary context current, as the runtime would
//   write_word(stream, address, value)    cuStreamWriteValue32: the word becomes value, after
//                                         everything queued on the stream before it
//   wait_word(stream, address, value)     cuStreamWaitValue32, GEQ: the stream waits until
//                                         (int32)(word - value) >= 0, a cyclic comparison
//   Lane                                  one mailbox's same-GPU call in one native call: copies the
//                                         input in, writes the input word, pushes the request, rings
//                                         the executor and queues the wait for the output word
//
// The driver (libcuda.so.1) is opened at first use, so the module builds and imports on machines
// without CUDA; available() says whether it could be opened. The GIL is released around each
// driver call: a call that blocks (a full stream queue) never stops the tenant's other threads.
// The slow twin of each is in proto/cuda_ipc.py (ctypes).

#include <pybind11/pybind11.h>

#include "shm.h"

#include <dlfcn.h>

#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>

namespace py = pybind11;

namespace {

using CUresult = int;
using CUstream = void*;
using CUdeviceptr = unsigned long long;
using CUcontext = void*;
using CUdevice = int;

struct Driver {
  CUresult (*memcpy_async)(CUdeviceptr, CUdeviceptr, size_t, CUstream) = nullptr;
  CUresult (*write_value32)(CUstream, CUdeviceptr, uint32_t, unsigned) = nullptr;
  CUresult (*wait_value32)(CUstream, CUdeviceptr, uint32_t, unsigned) = nullptr;
  CUresult (*error_string)(CUresult, const char**) = nullptr;
  CUresult (*ctx_get_current)(CUcontext*) = nullptr;
  CUresult (*ctx_set_current)(CUcontext) = nullptr;
  CUresult (*device_get)(CUdevice*, int) = nullptr;
  CUresult (*primary_ctx_retain)(CUcontext*, CUdevice) = nullptr;
  std::string why;  // why the driver could not be opened; empty when it was
};

template <typename F>
bool resolve(void* lib, F& fn, const char* name, const char* fallback = nullptr) {
  void* p = dlsym(lib, name);
  if (p == nullptr && fallback != nullptr) p = dlsym(lib, fallback);
  fn = reinterpret_cast<F>(p);
  return p != nullptr;
}

const Driver& driver() {
  static Driver d;
  static std::once_flag once;
  std::call_once(once, [] {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      const char* e = dlerror();
      d.why = std::string("libcuda.so.1 could not be opened: ") + (e ? e : "?");
      return;
    }
    // the _v2 stream memory operations exist since CUDA 11.7; the first ones before
    bool ok = resolve(lib, d.memcpy_async, "cuMemcpyAsync") &&
              resolve(lib, d.write_value32, "cuStreamWriteValue32_v2", "cuStreamWriteValue32") &&
              resolve(lib, d.wait_value32, "cuStreamWaitValue32_v2", "cuStreamWaitValue32") &&
              resolve(lib, d.error_string, "cuGetErrorString") &&
              resolve(lib, d.ctx_get_current, "cuCtxGetCurrent") && resolve(lib, d.ctx_set_current, "cuCtxSetCurrent") &&
              resolve(lib, d.device_get, "cuDeviceGet") && resolve(lib, d.primary_ctx_retain, "cuDevicePrimaryCtxRetain");
    if (!ok) d.why = "libcuda.so.1 lacks a driver function symbiont needs (a driver older than CUDA 11.7?)";
  });
  if (!d.why.empty()) throw std::runtime_error(d.why);
  return d;
}

void check(CUresult rc, const char* what) {
  if (rc == 0) return;
  const char* msg = nullptr;
  driver().error_string(rc, &msg);
  throw std::runtime_error(std::string(what) + " failed: CUDA error " + std::to_string(rc) + " (" + (msg ? msg : "?") + ")");
}

CUstream as_stream(uintptr_t stream) { return reinterpret_cast<CUstream>(stream); }

// Makes `device`'s primary context current in this thread unless some context is.
void ensure_context(const Driver& d, int device) {
  thread_local bool checked = false;
  if (checked) return;
  CUcontext ctx = nullptr;
  check(d.ctx_get_current(&ctx), "cuCtxGetCurrent");
  if (ctx == nullptr) {
    CUdevice dev = 0;
    check(d.device_get(&dev, device), "cuDeviceGet");
    check(d.primary_ctx_retain(&ctx, dev), "cuDevicePrimaryCtxRetain");
    check(d.ctx_set_current(ctx), "cuCtxSetCurrent");
  }
  checked = true;
}

void copy(uintptr_t dst, uintptr_t src, size_t nbytes, uintptr_t stream, int device) {
  const Driver& d = driver();
  ensure_context(d, device);
  CUresult rc;
  {
    py::gil_scoped_release release;
    rc = d.memcpy_async(dst, src, nbytes, as_stream(stream));
  }
  check(rc, "cuMemcpyAsync");
}

void write_word(uintptr_t stream, uintptr_t address, uint32_t value) {
  const Driver& d = driver();
  CUresult rc;
  {
    py::gil_scoped_release release;
    rc = d.write_value32(as_stream(stream), address, value, 0);
  }
  check(rc, "cuStreamWriteValue32");
}

void wait_word(uintptr_t stream, uintptr_t address, uint32_t value) {
  const Driver& d = driver();
  CUresult rc;
  {
    py::gil_scoped_release release;
    rc = d.wait_value32(as_stream(stream), address, value, 0 /* CU_STREAM_WAIT_VALUE_GEQ */);
  }
  check(rc, "cuStreamWaitValue32");
}

// The same-GPU call of client/transports/local.py on one mailbox, its steps in one native call (the
// Python steps it stands for cost ~50 us of host time per call: benchmarks/RESULTS.md). The
// request is the call's fixed fields serialised once (`header`, a CallRequest without call_id and
// input_seq) followed by those two as protobuf varint fields, which a parser takes in any order.
class Lane {
 public:
  Lane(py::object mailbox, size_t ring_offset, uint32_t nslots, uint32_t slot_size, py::object wake, uintptr_t dst,
       uintptr_t input_word, uintptr_t output_word, int device)
      : requests_(mailbox, ring_offset, nslots, slot_size), wake_(wake, 0), dst_(dst), input_word_(input_word),
        output_word_(output_word), device_(device) {}

  // Queues on `stream`: the copy of nbytes at src into the data area's start, the input word's
  // write of seq; then pushes the request and rings the executor, and queues the stream's wait for
  // the output word to reach seq. Returns 0; -1 when the request ring is full (nothing was done);
  // -2 when the copy and the word were queued but the request could not be pushed (another
  // producer); 1 when the request went but the wait could not be queued. Raises when the copy or
  // the write fails (the request did not go). pushed / waited: the seq of the last request pushed
  // and of the last wait queued, which say how far a call got when an interrupt is raised as this
  // returns (before its result can be read).
  int send(uintptr_t src, size_t nbytes, uintptr_t stream, const py::bytes& header, uint64_t call_id, uint32_t seq) {
    const Driver& d = driver();
    ensure_context(d, device_);
    char* head = nullptr;
    Py_ssize_t head_len = 0;
    PyBytes_AsStringAndSize(header.ptr(), &head, &head_len);
    uint8_t tail[2 + 10 + 1 + 5];
    size_t n = 0;
    tail[n++] = 0x08;  // field 1 (call_id), varint
    n = put_varint(tail, n, call_id);
    tail[n++] = 0x50;  // field 10 (input_seq), varint
    n = put_varint(tail, n, seq);
    if (static_cast<size_t>(head_len) + n > requests_.max_message()) {
      throw std::length_error("request of " + std::to_string(head_len + n) + " bytes exceeds a ring slot");
    }
    if (requests_.full()) return -1;
    CUresult rc = 0;
    const char* failed = nullptr;
    bool pushed = false;
    {
      py::gil_scoped_release release;
      if (nbytes && (rc = d.memcpy_async(dst_, src, nbytes, as_stream(stream))) != 0) failed = "cuMemcpyAsync";
      if (!failed && (rc = d.write_value32(as_stream(stream), input_word_, seq, 0)) != 0) failed = "cuStreamWriteValue32";
      if (!failed && requests_.push_parts(reinterpret_cast<const uint8_t*>(head), static_cast<size_t>(head_len), tail, n)) {
        pushed = true;
        pushed_ = seq;
        wake_.ring(/*wake_always=*/true);
        rc = d.wait_value32(as_stream(stream), output_word_, seq, 0 /* GEQ */);
        if (rc == 0) waited_ = seq;
      }
    }
    if (failed) check(rc, failed);
    if (!pushed) return -2;
    return rc == 0 ? 0 : 1;
  }

  uint32_t pushed() const { return pushed_; }
  uint32_t waited() const { return waited_; }

 private:
  static size_t put_varint(uint8_t* buf, size_t n, uint64_t v) {
    while (v >= 0x80) {
      buf[n++] = static_cast<uint8_t>(v | 0x80);
      v >>= 7;
    }
    buf[n++] = static_cast<uint8_t>(v);
    return n;
  }

  symbiont_shm::Ring requests_;
  symbiont_shm::Doorbell wake_;
  uintptr_t dst_, input_word_, output_word_;
  int device_;
  uint32_t pushed_ = 0, waited_ = 0;
};

bool available() {
  try {
    driver();
    return true;
  } catch (const std::runtime_error&) {
    return false;
  }
}

}  // namespace

PYBIND11_MODULE(_stream_ops, m) {
  m.doc() = "CUDA driver stream operations for symbiont's same-GPU calls (copy, word write, word wait).";
  m.def("available", &available, "Whether the CUDA driver could be opened.");
  m.def("copy", &copy, py::arg("dst"), py::arg("src"), py::arg("nbytes"), py::arg("stream"), py::arg("device"));
  m.def("write_word", &write_word, py::arg("stream"), py::arg("address"), py::arg("value"));
  m.def("wait_word", &wait_word, py::arg("stream"), py::arg("address"), py::arg("value"));
  py::class_<Lane>(m, "Lane")
      .def(py::init<py::object, size_t, uint32_t, uint32_t, py::object, uintptr_t, uintptr_t, uintptr_t, int>(),
           py::arg("mailbox"), py::arg("ring_offset"), py::arg("nslots"), py::arg("slot_size"), py::arg("wake"),
           py::arg("dst"), py::arg("input_word"), py::arg("output_word"), py::arg("device"))
      .def("send", &Lane::send, py::arg("src"), py::arg("nbytes"), py::arg("stream"), py::arg("header"),
           py::arg("call_id"), py::arg("seq"))
      .def_property_readonly("pushed", &Lane::pushed)
      .def_property_readonly("waited", &Lane::waited);
}
