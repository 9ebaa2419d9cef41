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

// After a kernel launch: launch errors (bad configuration) surface here.
#define MT_CUDA_CHECK_LAUNCH(name) MT_CUDA_CHECK(cudaPeekAtLastError())
