// proto._doorbell: the shared-memory signalling used by the same-host transport.
//
// Two objects, both views into a writable buffer (an mmap of a sealed memfd):
//
//   Ring      single-producer / single-consumer queue of fixed-size slots. Each
//             slot holds one length-prefixed message (a serialised protobuf).
//             Layout at `offset`:
//               [  0,   8)  head  (uint64, written by the producer only)
//               [ 64,  72)  tail  (uint64, written by the consumer only)
//               [128, 128 + nslots * slot_size)  slots: uint32 length + payload
//             Geometry (nslots, slot_size) is a constructor argument, never read
//             from shared memory: a peer that scribbles over the header can only
//             make pop() raise, never make us read out of bounds.
//
//   Doorbell  a 32-bit sequence word plus a waiter count (futex). ring() bumps
//             the sequence and wakes sleepers only when someone sleeps; wait()
//             spins for a short while, then sleeps in FUTEX_WAIT, with the GIL
//             released the whole time. The executor owns one executor-wide
//             Doorbell (its wake word) that every tenant rings, so one thread
//             can wait on all tenants at once; each tenant owns one for replies.
//             Layout at `offset`: [0,4) sequence, [4,8) waiters.

#include "shm.h"

namespace py = pybind11;
using symbiont_shm::Doorbell;
using symbiont_shm::Ring;


PYBIND11_MODULE(_doorbell, m) {
  m.doc() = "Shared-memory SPSC rings and futex doorbells for symbiont's same-host transport.";
  static_assert(sizeof(std::atomic<uint64_t>) == 8 && std::atomic<uint64_t>::is_always_lock_free);
  static_assert(sizeof(std::atomic<uint32_t>) == 4 && std::atomic<uint32_t>::is_always_lock_free);

  py::class_<Ring>(m, "Ring")
      .def(py::init<py::object, size_t, uint32_t, uint32_t>(), py::arg("buffer"), py::arg("offset"),
           py::arg("nslots"), py::arg("slot_size"))
      .def_static("bytes_needed", &Ring::bytes_needed, py::arg("nslots"), py::arg("slot_size"))
      .def_property_readonly("max_message", &Ring::max_message)
      .def("push", &Ring::push, py::arg("message"))
      .def("pop", &Ring::pop)
      .def("pending", &Ring::pending)
      .def("reset", &Ring::reset);

  py::class_<Doorbell>(m, "Doorbell")
      .def(py::init<py::object, size_t>(), py::arg("buffer"), py::arg("offset"))
      .def("seq", &Doorbell::seq)
      .def("ring", &Doorbell::ring, py::arg("wake_always") = false)
      .def("wait", &Doorbell::wait, py::arg("seen"), py::arg("spin_us") = 50, py::arg("timeout_us") = -1);
}
