// The allocator interface of tensor storage, and the copies and fills core's
// own tensor functions need (copy_, fill_). Core sits below backend/, so it
// declares here what it needs from a device and the backends define it: the host
// allocator in backend/cpu/allocator.cpp; the CUDA calls in backend/cuda/
// runtime.cpp and memory.cu (runtime_disabled.cpp without CUDA, where they throw).
// The rest of the library reaches them through backend/cpu/allocator.h and
// backend/cuda/runtime.h, which include this file.
#pragma once

#include <cstdint>

#include "core/dtype.h"

namespace moetrain::cpu {

// Host memory (backend/cpu/allocator.h has the caching policy and its statistics):
// 64-byte (small) or 2 MiB (large) aligned memory of at least nbytes; *capacity
// receives the block's real size, to pass back to host_free.
void* host_alloc(int64_t nbytes, int64_t* capacity);
void host_free(void* ptr, int64_t capacity);

}  // namespace moetrain::cpu

namespace moetrain::cuda {

// Device memory, through the device's caching allocator (backend/cuda/
// caching_allocator.h). device_malloc throws OutOfMemoryError naming the request,
// free/total and the largest holders.
void* device_malloc(int64_t nbytes, int device);
void device_free(void* ptr, int device);

// Copies on the device's stream (backend/cuda/runtime.h: ordering). Copies to the
// host wait for the stream; copies from the host return once the source may be reused.
void copy_host_to_device(void* dst, const void* src, int64_t nbytes, int device);
void copy_device_to_host(void* dst, const void* src, int64_t nbytes, int device);
void copy_device_to_device(void* dst, const void* src, int64_t nbytes, int device);
// n elements of `dtype` at dst = value (memory.cu).
void fill(void* dst, DType dtype, int64_t n, double value, int device);

}  // namespace moetrain::cuda
