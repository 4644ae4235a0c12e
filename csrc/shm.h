// Shared-memory signalling of the same-host transport, used by proto._doorbell (csrc/doorbell.cpp)
// and by the same-GPU call lane of proto._stream_ops (csrc/stream_ops.cpp). Layouts: doorbell.cpp.
#pragma once

#include <pybind11/pybind11.h>

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <stdexcept>
#include <string>

namespace symbiont_shm {

namespace py = pybind11;


constexpr size_t kHeadOffset = 0;
constexpr size_t kTailOffset = 64;
constexpr size_t kSlotsOffset = 128;

inline long futex(uint32_t* addr, int op, uint32_t val, const struct timespec* timeout) {
  // Shared (not FUTEX_PRIVATE) futexes: the word lives in memory mapped by several processes.
  return syscall(SYS_futex, addr, op, val, timeout, nullptr, 0);
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// Holds a buffer export (so the mmap cannot be closed under us) and gives the
// raw address of a writable region inside it.
struct Region {
  py::buffer_info info;
  uint8_t* base = nullptr;

  Region(py::object buffer, size_t offset, size_t nbytes)
      : info(py::reinterpret_borrow<py::buffer>(buffer).request(/*writable=*/true)) {
    size_t total = static_cast<size_t>(info.size) * static_cast<size_t>(info.itemsize);
    if (offset + nbytes > total) {
      throw std::out_of_range("region [" + std::to_string(offset) + ", " + std::to_string(offset + nbytes) +
                              ") does not fit in a buffer of " + std::to_string(total) + " bytes");
    }
    base = static_cast<uint8_t*>(info.ptr) + offset;
    if (reinterpret_cast<uintptr_t>(base) % 64 != 0) {
      throw std::invalid_argument("region offset must leave the region 64-byte aligned");
    }
  }
};

class Ring {
 public:
  Ring(py::object buffer, size_t offset, uint32_t nslots, uint32_t slot_size)
      : region_(buffer, offset, bytes_needed(nslots, slot_size)), nslots_(nslots), slot_size_(slot_size) {
    if (nslots == 0 || slot_size < 8 || slot_size % 8 != 0) {
      throw std::invalid_argument("nslots must be > 0 and slot_size a multiple of 8 (>= 8)");
    }
  }

  static size_t bytes_needed(uint32_t nslots, uint32_t slot_size) {
    return kSlotsOffset + static_cast<size_t>(nslots) * slot_size;
  }

  uint32_t max_message() const { return slot_size_ - 4; }

  // Producer side. False when the ring is full (the consumer has not caught up).
  bool push(const py::bytes& message) {
    char* data = nullptr;
    Py_ssize_t len = 0;
    PyBytes_AsStringAndSize(message.ptr(), &data, &len);
    return push_parts(reinterpret_cast<const uint8_t*>(data), static_cast<size_t>(len), nullptr, 0);
  }

  // Whether a push would find no free slot now (only the producer fills slots).
  bool full() { return head_ref().load(std::memory_order_relaxed) - tail_ref().load(std::memory_order_acquire) >= nslots_; }

  // Producer side: one message made of two parts written one after the other. False when full.
  bool push_parts(const uint8_t* a, size_t a_len, const uint8_t* b, size_t b_len) {
    if (a_len + b_len > max_message()) {
      throw std::length_error("message of " + std::to_string(a_len + b_len) +
                              " bytes exceeds the ring's slot payload of " + std::to_string(max_message()) + " bytes");
    }
    uint64_t head = head_ref().load(std::memory_order_relaxed);
    uint64_t tail = tail_ref().load(std::memory_order_acquire);
    if (head - tail >= nslots_) return false;
    uint8_t* slot = slot_at(head);
    uint32_t len32 = static_cast<uint32_t>(a_len + b_len);
    std::memcpy(slot, &len32, 4);
    std::memcpy(slot + 4, a, a_len);
    if (b_len) std::memcpy(slot + 4 + a_len, b, b_len);
    head_ref().store(head + 1, std::memory_order_release);
    return true;
  }

  // Consumer side. None when empty; raises ValueError when the shared indices or
  // the length prefix are inconsistent (a peer corrupted the ring).
  py::object pop() {
    uint64_t tail = tail_ref().load(std::memory_order_relaxed);
    uint64_t head = head_ref().load(std::memory_order_acquire);
    if (head == tail) return py::none();
    if (head - tail > nslots_) {
      throw py::value_error("ring corrupt: head " + std::to_string(head) + " is " + std::to_string(head - tail) +
                            " slots ahead of tail " + std::to_string(tail) + " (capacity " +
                            std::to_string(nslots_) + ")");
    }
    const uint8_t* slot = slot_at(tail);
    uint32_t len32 = 0;
    std::memcpy(&len32, slot, 4);
    if (len32 > max_message()) {
      tail_ref().store(tail + 1, std::memory_order_release);
      throw py::value_error("ring corrupt: message length " + std::to_string(len32) + " exceeds slot payload " +
                            std::to_string(max_message()));
    }
    py::bytes out(reinterpret_cast<const char*>(slot + 4), len32);
    tail_ref().store(tail + 1, std::memory_order_release);
    return std::move(out);
  }

  // Consumer side: the message at the front, left there (its length; *msg null when the ring
  // is empty or its indices or length prefix are inconsistent, which pop() then reports).
  uint32_t peek(const uint8_t** msg) {
    *msg = nullptr;
    uint64_t tail = tail_ref().load(std::memory_order_relaxed);
    uint64_t head = head_ref().load(std::memory_order_acquire);
    if (head == tail || head - tail > nslots_) return 0;
    const uint8_t* slot = slot_at(tail);
    uint32_t len32 = 0;
    std::memcpy(&len32, slot, 4);
    if (len32 > max_message()) return 0;
    *msg = slot + 4;
    return len32;
  }

  // Consumer side, after peek() found a message: it is consumed.
  void drop_front() {
    tail_ref().store(tail_ref().load(std::memory_order_relaxed) + 1, std::memory_order_release);
  }

  uint64_t pending() const {
    uint64_t head = const_cast<Ring*>(this)->head_ref().load(std::memory_order_acquire);
    uint64_t tail = const_cast<Ring*>(this)->tail_ref().load(std::memory_order_acquire);
    return head - tail;
  }

  // Producer-side reset; only safe while no consumer is active (at attach).
  void reset() {
    head_ref().store(0, std::memory_order_relaxed);
    tail_ref().store(0, std::memory_order_release);
  }

 private:
  std::atomic<uint64_t>& head_ref() { return *reinterpret_cast<std::atomic<uint64_t>*>(region_.base + kHeadOffset); }
  std::atomic<uint64_t>& tail_ref() { return *reinterpret_cast<std::atomic<uint64_t>*>(region_.base + kTailOffset); }
  uint8_t* slot_at(uint64_t index) const {
    return region_.base + kSlotsOffset + static_cast<size_t>(index % nslots_) * slot_size_;
  }

  Region region_;
  uint32_t nslots_;
  uint32_t slot_size_;
};

class Doorbell {
 public:
  Doorbell(py::object buffer, size_t offset) : region_(buffer, offset, 8) {}

  uint32_t seq() { return seq_ref().load(std::memory_order_acquire); }

  // wake_always: skip the waiter count, which a peer sharing this memory could forge to make
  // every wake-up of the executor's wake word go missing; costs one syscall.
  void ring(bool wake_always) {
    seq_ref().fetch_add(1, std::memory_order_acq_rel);
    if (wake_always || waiters_ref().load(std::memory_order_acquire) > 0) {
      futex(seq_ptr(), FUTEX_WAKE, INT_MAX, nullptr);
    }
  }

  // Waits until the sequence differs from `seen` or `timeout_us` passes
  // (negative: forever). Spins for `spin_us` first, never past the timeout. Returns the
  // sequence now.
  uint32_t wait(uint32_t seen, int64_t spin_us, int64_t timeout_us) {
    py::gil_scoped_release release;
    using clock = std::chrono::steady_clock;
    const auto start = clock::now();
    if (timeout_us >= 0 && spin_us > timeout_us) spin_us = timeout_us;
    const auto spin_until = start + std::chrono::microseconds(spin_us);
    uint32_t now = seq_ref().load(std::memory_order_acquire);
    while (now == seen && clock::now() < spin_until) {
      for (int i = 0; i < 64 && now == seen; ++i) {
        cpu_relax();
        now = seq_ref().load(std::memory_order_acquire);
      }
    }
    while (now == seen) {
      struct timespec ts;
      const struct timespec* tsp = nullptr;
      if (timeout_us >= 0) {
        auto left = std::chrono::duration_cast<std::chrono::microseconds>(
                        start + std::chrono::microseconds(timeout_us) - clock::now())
                        .count();
        if (left <= 0) break;
        ts.tv_sec = left / 1000000;
        ts.tv_nsec = (left % 1000000) * 1000;
        tsp = &ts;
      }
      waiters_ref().fetch_add(1, std::memory_order_acq_rel);
      futex(seq_ptr(), FUTEX_WAIT, seen, tsp);  // returns at once if the word already moved
      waiters_ref().fetch_sub(1, std::memory_order_acq_rel);
      now = seq_ref().load(std::memory_order_acquire);
    }
    return now;
  }

 private:
  uint32_t* seq_ptr() { return reinterpret_cast<uint32_t*>(region_.base); }
  std::atomic<uint32_t>& seq_ref() { return *reinterpret_cast<std::atomic<uint32_t>*>(region_.base); }
  std::atomic<int32_t>& waiters_ref() { return *reinterpret_cast<std::atomic<int32_t>*>(region_.base + 4); }

  Region region_;
};

}  // namespace symbiont_shm
