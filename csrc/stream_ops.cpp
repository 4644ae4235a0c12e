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
//   ServeLane                             the executor's side of one such mailbox: serves the calls
//                                         at its request ring's front that repeat a call already run
//                                         as a CUDA graph replay (a wait for the input word, the
//                                         graph's launch, the output word's write, the reply), with
//                                         no Python per call
//
// The driver (libcuda.so.1) is opened at first use, so the module builds and imports on machines
// without CUDA; available() says whether it could be opened. The GIL is released around each
// driver call: a call that blocks (a full stream queue) never stops the tenant's other threads.
// The slow twin of each is in proto/cuda_ipc.py (ctypes).

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "shm.h"

#include <dlfcn.h>

#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>
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
  CUresult (*graph_launch)(void*, CUstream) = nullptr;
  CUresult (*stream_query)(CUstream) = nullptr;
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
              resolve(lib, d.device_get, "cuDeviceGet") && resolve(lib, d.primary_ctx_retain, "cuDevicePrimaryCtxRetain") &&
              resolve(lib, d.graph_launch, "cuGraphLaunch") && resolve(lib, d.stream_query, "cuStreamQuery");
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
  // returns (before its result can be read). wait=false leaves the wait out (a step program's run:
  // the caller queues the step's graph first, whose words the executor's side waits for).
  int send(uintptr_t src, size_t nbytes, uintptr_t stream, const py::bytes& header, uint64_t call_id, uint32_t seq,
           bool wait = true) {
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
        if (wait) {
          rc = d.wait_value32(as_stream(stream), output_word_, seq, 0 /* GEQ */);
          if (rc == 0) waited_ = seq;
        }
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

// A request as Lane::send writes it: a header (a CallRequest with neither call_id nor input_seq),
// then call_id (field 1) and input_seq (field 10) as varints, and nothing after. Walks the
// protobuf fields up to the first field 1; false when the request is not of that shape.
bool split_request(const uint8_t* p, size_t len, size_t* header_len, uint64_t* call_id, uint32_t* seq) {
  auto varint = [&](size_t& i, uint64_t& v) {
    v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (i >= len) return false;
      uint8_t b = p[i++];
      v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if (!(b & 0x80)) return true;
    }
    return false;
  };
  size_t i = 0;
  while (i < len) {
    size_t start = i;
    uint64_t tag = 0, v = 0;
    if (!varint(i, tag)) return false;
    uint64_t field = tag >> 3, wire = tag & 7;
    if (field == 1 && wire == 0) {  // the tail: call_id, input_seq, end
      *header_len = start;
      uint64_t s = 0;
      if (!varint(i, v) || i >= len || p[i++] != 0x50 || !varint(i, s) || i != len || s == 0 || s > 0xFFFFFFFFull) return false;
      *call_id = v;
      *seq = static_cast<uint32_t>(s);
      return true;
    }
    if (field == 1 || field == 10) return false;
    switch (wire) {
      case 0:
        if (!varint(i, v)) return false;
        break;
      case 1:
        i += 8;
        break;
      case 2:
        if (!varint(i, v) || v > len - i) return false;
        i += v;
        break;
      case 5:
        i += 4;
        break;
      default:
        return false;
    }
    if (i > len) return false;
  }
  return false;
}

// The executor's side of one same-GPU mailbox whose words its GPU can wait on. Python serves a
// call the first times (checks, scheduling, a CUDA graph captured on this mailbox's own stream)
// and then teaches the lane its request header (learn); from then on serve() takes the requests
// with that exact header off the ring's front and, for each, queues on the stream the wait for
// its input word, the graph's launch and the output word's write, then pushes the reply Python
// would push (the reply learnt, with this call's call_id). The first request it does not know
// (or a full reply ring) stops it: Python takes it from there, so the calls keep their order.
// Only the data loop uses a lane, under the server's lock.
class ServeLane {
 public:
  ServeLane(py::object mailbox, size_t request_ring_offset, size_t reply_ring_offset, uint32_t nslots,
            uint32_t slot_size, size_t reply_bell_offset, uintptr_t stream, uintptr_t input_word,
            uintptr_t output_word, int device, size_t input_word_offset)
      : requests_(mailbox, request_ring_offset, nslots, slot_size),
        replies_(mailbox, reply_ring_offset, nslots, slot_size),
        bell_(mailbox, reply_bell_offset),
        input_seen_(mailbox, input_word_offset & ~size_t(63), 64),
        input_in_page_(input_word_offset & 63),
        stream_(stream),
        input_word_(input_word),
        output_word_(output_word),
        device_(device) {
    if (input_word_offset % 4 != 0) throw std::invalid_argument("input_word_offset must be 4-byte aligned");
  }

  // Serves calls of `header` from now on: `graph_exec` (a cudaGraphExec_t the caller keeps alive
  // until forget) computes it, `reply` is its CallReply without call_id; `index` names it in counts().
  void learn(const py::bytes& header, uintptr_t graph_exec, const py::bytes& reply, uint32_t index) {
    entries_[std::string(header)] = Entry{graph_exec, std::string(reply), index, 0, {}, 0, 0, 0};
  }

  // Serves the runs of a step program (base_executor/transports/programs.py) from now on: for each,
  // call k's graph (graph_execs[k - 1]) behind a wait for the program input word to reach k, and
  // the program output word's write of k after it (and to program_out_also before it, where
  // non-zero: the host's word beside a device word); the input word is set back to 0 after the last wait. The
  // caller keeps the graphs alive until forget.
  void learn_program(const py::bytes& header, const std::vector<uintptr_t>& graph_execs, uintptr_t program_in,
                     uintptr_t program_out, const py::bytes& reply, uint32_t index, uintptr_t program_out_also) {
    if (graph_execs.empty()) throw std::invalid_argument("a step program holds at least one call");
    entries_[std::string(header)] = Entry{0, std::string(reply), index, 0, graph_execs, program_in, program_out,
                                          program_out_also};
  }

  void forget(const py::bytes& header) {
    auto it = entries_.find(std::string(header));
    if (it != entries_.end()) {
      unfolded_.emplace_back(it->second.index, it->second.served);
      entries_.erase(it);
    }
  }

  size_t size() const { return entries_.size(); }

  // Serves at most `most` calls off the ring's front (see the class); returns how many.
  int serve(int most) {
    const Driver& d = driver();
    ensure_context(d, device_);
    int n = 0;
    const char* failed = nullptr;
    CUresult rc = 0;
    std::string key;
    {
      py::gil_scoped_release release;
      while (n < most && !replies_.full()) {
        const uint8_t* msg = nullptr;
        uint32_t len = requests_.peek(&msg);
        size_t header_len = 0;
        uint64_t call_id = 0;
        uint32_t seq = 0;
        if (msg == nullptr || !split_request(msg, len, &header_len, &call_id, &seq)) break;
        key.assign(reinterpret_cast<const char*>(msg), header_len);
        auto it = entries_.find(key);
        if (it == entries_.end()) break;
        Entry& e = it->second;
        if (n == 0) was_idle_ = d.stream_query(as_stream(stream_)) == 0;
        bool late = input_reached(seq);  // (the tenant's GPU got here first: it waited for us)
        if ((rc = d.wait_value32(as_stream(stream_), input_word_, seq, 0 /* GEQ */)) != 0) { failed = "cuStreamWaitValue32"; break; }
        requests_.drop_front();  // (its GPU wait is queued: from here on it is ours)
        late_ += late;
        awaiting_ = seq;
        if (e.program.empty()) {
          if ((rc = d.graph_launch(reinterpret_cast<void*>(e.graph_exec), as_stream(stream_))) != 0) { failed = "cuGraphLaunch"; ++n; break; }
        } else if ((failed = run_program(d, e, &rc)) != nullptr) {
          ++n;
          break;
        }
        if ((rc = d.write_value32(as_stream(stream_), output_word_, seq, 0)) != 0) { failed = "cuStreamWriteValue32"; ++n; break; }
        uint8_t head[1 + 10];
        size_t h = 0;
        head[h++] = 0x08;  // field 1 (call_id), varint; a parser merges it with the rest
        while (call_id >= 0x80) {
          head[h++] = static_cast<uint8_t>(call_id | 0x80);
          call_id >>= 7;
        }
        head[h++] = static_cast<uint8_t>(call_id);
        replies_.push_parts(head, h, reinterpret_cast<const uint8_t*>(e.reply.data()), e.reply.size());
        ++e.served;
        ++n;
      }
      if (n) bell_.ring(false);
    }
    if (failed) check(rc, failed);
    return n;
  }

  // (index, calls served) per entry since the last call, forgotten entries included; resets them.
  py::list take_counts() {
    py::list out;
    for (auto& [index, served] : unfolded_) out.append(py::make_tuple(index, served));
    unfolded_.clear();
    for (auto& [header, e] : entries_) {
      if (e.served) out.append(py::make_tuple(e.index, e.served));
      e.served = 0;
    }
    return out;
  }

  // The input_seq the stream was last made to wait for (0: none yet).
  uint32_t awaiting() const { return awaiting_; }
  // Calls served whose input was in already when their wait was queued (the tenant's GPU reached
  // the call before this lane did): how often the host's round trip was on the tenant's path.
  uint64_t late() const { return late_; }
  // Whether the stream had finished all its work when the last serve() that served began.
  bool was_idle() const { return was_idle_; }

 private:
  struct Entry {
    uintptr_t graph_exec;
    std::string reply;
    uint32_t index;
    uint64_t served;
    std::vector<uintptr_t> program;  // a step program's graphs, call by call (graph_exec unused)
    uintptr_t program_in, program_out, program_out_also;  // its words (program_out_also: 0, or a second output word)
  };

  // Queues one run of a step program (learn_program); the failing driver call's name, or nullptr.
  const char* run_program(const Driver& d, const Entry& e, CUresult* rc) {
    CUstream s = as_stream(stream_);
    const uint32_t n = static_cast<uint32_t>(e.program.size());
    for (uint32_t k = 1; k <= n; ++k) {
      if ((*rc = d.wait_value32(s, e.program_in, k, 0 /* GEQ */)) != 0) return "cuStreamWaitValue32";
      if (k == n && (*rc = d.write_value32(s, e.program_in, 0, 0)) != 0) return "cuStreamWriteValue32";
      if ((*rc = d.graph_launch(reinterpret_cast<void*>(e.program[k - 1]), s)) != 0) return "cuGraphLaunch";
      // (the second word first: a waiter that saw program_out and sets both back finds it written)
      if (e.program_out_also && (*rc = d.write_value32(s, e.program_out_also, k, 0)) != 0) return "cuStreamWriteValue32";
      if ((*rc = d.write_value32(s, e.program_out, k, 0)) != 0) return "cuStreamWriteValue32";
    }
    return nullptr;
  }

  // The host's reading of the GPU wait's condition (proto/cuda_ipc.py reached()).
  bool input_reached(uint32_t seq) const {
    uint32_t word = reinterpret_cast<const std::atomic<uint32_t>*>(input_seen_.base + input_in_page_)->load(std::memory_order_acquire);
    return static_cast<uint32_t>(word - seq) < 0x80000000u;
  }

  symbiont_shm::Ring requests_, replies_;
  symbiont_shm::Doorbell bell_;
  symbiont_shm::Region input_seen_;
  size_t input_in_page_;
  uintptr_t stream_, input_word_, output_word_;
  int device_;
  std::unordered_map<std::string, Entry> entries_;
  std::vector<std::pair<uint32_t, uint64_t>> unfolded_;
  uint64_t late_ = 0;
  uint32_t awaiting_ = 0;
  bool was_idle_ = false;
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
           py::arg("call_id"), py::arg("seq"), py::arg("wait") = true)
      .def_property_readonly("pushed", &Lane::pushed)
      .def_property_readonly("waited", &Lane::waited);
  py::class_<ServeLane>(m, "ServeLane")
      .def(py::init<py::object, size_t, size_t, uint32_t, uint32_t, size_t, uintptr_t, uintptr_t, uintptr_t, int, size_t>(),
           py::arg("mailbox"), py::arg("request_ring_offset"), py::arg("reply_ring_offset"), py::arg("nslots"),
           py::arg("slot_size"), py::arg("reply_bell_offset"), py::arg("stream"), py::arg("input_word"),
           py::arg("output_word"), py::arg("device"), py::arg("input_word_offset"))
      .def("learn", &ServeLane::learn, py::arg("header"), py::arg("graph_exec"), py::arg("reply"), py::arg("index"))
      .def("learn_program", &ServeLane::learn_program, py::arg("header"), py::arg("graph_execs"), py::arg("program_in"),
           py::arg("program_out"), py::arg("reply"), py::arg("index"), py::arg("program_out_also") = 0)
      .def("forget", &ServeLane::forget, py::arg("header"))
      .def("serve", &ServeLane::serve, py::arg("most"))
      .def("take_counts", &ServeLane::take_counts)
      .def("__len__", &ServeLane::size)
      .def_property_readonly("awaiting", &ServeLane::awaiting)
      .def_property_readonly("late", &ServeLane::late)
      .def_property_readonly("was_idle", &ServeLane::was_idle);
  m.def("split_request", [](const py::bytes& raw) -> py::object {
    std::string s(raw);
    size_t header_len = 0;
    uint64_t call_id = 0;
    uint32_t seq = 0;
    if (!split_request(reinterpret_cast<const uint8_t*>(s.data()), s.size(), &header_len, &call_id, &seq)) return py::none();
    return py::make_tuple(header_len, call_id, seq);
  }, py::arg("raw"), "(header length, call_id, input_seq) of a request as Lane.send writes it, else None.");
}
