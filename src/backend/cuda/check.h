// MT_CUDA_CHECK / MT_CUBLAS_CHECK: a failed CUDA or cuBLAS call throws
// moetrain::Error naming the call and the library's error text. For files
// compiled with the CUDA toolkit only.
#pragma once

#include <cuda_runtime.h>

#include "core/error.h"

#define MT_CUDA_CHECK(call)                                                                             \
  do {                                                                                                  \
    cudaError_t err_ = (call);                                                                          \
    if (err_ != cudaSuccess) [[unlikely]]                                                               \
      throw ::moetrain::Error(::fmt::format("CUDA call {} failed: {} ({})", #call, cudaGetErrorString(err_), \
                                            static_cast<int>(err_)));                                   \
  } while (0)

// After a kernel launch (cuda::launch in launch.cuh does it for every kernel): a
// launch error (bad configuration, too many resources) surfaces here, naming the
// kernel. cudaGetLastError clears the error it returns, so one failed launch is
// reported once, not again under the name of every later kernel (which
// cudaPeekAtLastError did). Errors of a kernel's execution (an illegal address)
// are sticky in the context: those every later call reports, as CUDA defines.
#define MT_CUDA_CHECK_LAUNCH(name)                                                              \
  do {                                                                                          \
    cudaError_t err_ = cudaGetLastError();                                                      \
    if (err_ != cudaSuccess) [[unlikely]]                                                       \
      throw ::moetrain::Error(::fmt::format("CUDA kernel {}: launch failed: {} ({})", (name),   \
                                            cudaGetErrorString(err_), static_cast<int>(err_))); \
  } while (0)
