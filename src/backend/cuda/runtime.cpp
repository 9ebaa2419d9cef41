// CUDA runtime calls (compiled only when the CUDA backend is on). Synchronous
// copies and plain cudaMalloc for now; the CUDA backend issue replaces this with
// streams and a caching allocator behind the same functions.
#include "backend/cuda/runtime.h"

#include <cuda_runtime.h>

#include "core/error.h"

#define MT_CUDA_CHECK(call)                                                              \
  do {                                                                                   \
    cudaError_t err_ = (call);                                                           \
    MT_CHECK(err_ == cudaSuccess, "CUDA call {} failed: {} ({})", #call, cudaGetErrorString(err_), \
             static_cast<int>(err_));                                                    \
  } while (0)

namespace moetrain::cuda {

bool built_with_cuda() { return true; }

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return n;
}

std::string device_name(int device) {
  cudaDeviceProp prop{};
  MT_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  return prop.name;
}

void* device_malloc(int64_t nbytes, int device) {
  MT_CHECK(device < device_count(), "cuda:{} requested but {} CUDA device(s) are visible", device, device_count());
  MT_CUDA_CHECK(cudaSetDevice(device));
  void* p = nullptr;
  cudaError_t err = cudaMalloc(&p, static_cast<size_t>(nbytes));
  if (err != cudaSuccess) {
    size_t free_b = 0, total_b = 0;
    cudaMemGetInfo(&free_b, &total_b);
    MT_THROW("CUDA out of memory on cuda:{}: requested {} bytes, {} of {} bytes free ({})", device, nbytes,
             free_b, total_b, cudaGetErrorString(err));
  }
  return p;
}

void device_free(void* ptr, int device) {
  cudaSetDevice(device);
  cudaFree(ptr);  // never throws from a destructor path
}

void copy_host_to_device(void* dst, const void* src, int64_t nbytes, int device) {
  MT_CUDA_CHECK(cudaSetDevice(device));
  MT_CUDA_CHECK(cudaMemcpy(dst, src, static_cast<size_t>(nbytes), cudaMemcpyHostToDevice));
}

void copy_device_to_host(void* dst, const void* src, int64_t nbytes, int device) {
  MT_CUDA_CHECK(cudaSetDevice(device));
  MT_CUDA_CHECK(cudaMemcpy(dst, src, static_cast<size_t>(nbytes), cudaMemcpyDeviceToHost));
}

void copy_device_to_device(void* dst, const void* src, int64_t nbytes, int device) {
  MT_CUDA_CHECK(cudaSetDevice(device));
  MT_CUDA_CHECK(cudaMemcpy(dst, src, static_cast<size_t>(nbytes), cudaMemcpyDeviceToDevice));
}

}  // namespace moetrain::cuda
