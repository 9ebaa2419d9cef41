// CUDA device runtime: the calls the core needs to place tensors on a GPU.
// Built from runtime.cpp with the CUDA toolkit when MOETRAIN_CUDA is on; without
// it every call throws a moetrain::Error that says how to get a CUDA build.
// (Caching allocator, streams and kernels: the CUDA backend issue.)
#pragma once

#include <cstdint>
#include <string>

namespace moetrain::cuda {

bool built_with_cuda();
int device_count();                    // 0 when no driver or no GPU
std::string device_name(int device);
void* device_malloc(int64_t nbytes, int device);
void device_free(void* ptr, int device);
void copy_host_to_device(void* dst, const void* src, int64_t nbytes, int device);
void copy_device_to_host(void* dst, const void* src, int64_t nbytes, int device);
void copy_device_to_device(void* dst, const void* src, int64_t nbytes, int device);

}  // namespace moetrain::cuda
