// Storage: one reference-counted allocation on one device. Tensors share a
// Storage through std::shared_ptr; views (reshape, leading-dim slices) point into
// the same Storage at an element offset.
#pragma once

#include <cstdint>
#include <memory>

#include "core/device.h"

namespace moetrain {

class Storage {
 public:
  Storage(int64_t nbytes, Device device);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return data_; }
  int64_t nbytes() const { return nbytes_; }
  Device device() const { return device_; }

 private:
  void* data_ = nullptr;
  int64_t nbytes_ = 0;
  int64_t capacity_ = 0;  // of the host block (core/memory.h, backend/cpu/allocator.h)
  Device device_;
};

}  // namespace moetrain
