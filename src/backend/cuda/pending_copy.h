// A copy from device memory to the host that does not stop the host
// (docs/cuda.md, "Host synchronisation"): queued on the device's stream into
// pinned host memory, with an event behind it. The host goes on queuing work that
// does not need the bytes, and waits only in wait(). Defined in runtime.cpp
// (runtime_disabled.cpp without CUDA, where constructing one throws).
// No CUDA header here: ops include this file.
#pragma once

#include <cstdint>

namespace moetrain::cuda {

class PendingCopy {
 public:
  // Queues the copy of nbytes (> 0) at src, device memory of `device`.
  PendingCopy(const void* src, int64_t nbytes, int device);
  ~PendingCopy();
  PendingCopy(PendingCopy&& other) noexcept;
  PendingCopy& operator=(PendingCopy&&) = delete;
  PendingCopy(const PendingCopy&) = delete;
  PendingCopy& operator=(const PendingCopy&) = delete;

  // Blocks until the bytes have arrived; they stay valid while this object lives.
  const void* wait();

 private:
  void* host_ = nullptr;   // pinned, from the device's pool (capacity_ bytes)
  void* event_ = nullptr;  // cudaEvent_t, recorded after the copy
  int64_t capacity_ = 0;
  int device_ = -1;
  bool arrived_ = false;
};

}  // namespace moetrain::cuda
