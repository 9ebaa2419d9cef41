#pragma once

#include <cstdint>
#include <vector>

#include "backend/cuda/runtime.h"
#include "core/tensor.h"

namespace moetrain {

namespace cpu {

// Shapes as in ops/moe/moe.h; y and dx are written, dw is written (experts without rows: zeros).
void grouped_linear_forward(Tensor& y, const Tensor& x, const Tensor& w, const std::vector<int64_t>& counts);
void grouped_linear_backward(Tensor& dx, Tensor& dw, const Tensor& dy, const Tensor& x, const Tensor& w,
                             const std::vector<int64_t>& counts);

}  // namespace cpu

// The CUDA twins (moe_cuda.cu, cuBLAS per expert).
namespace cuda {
MT_CUDA_KERNEL(void grouped_linear_forward(Tensor& y, const Tensor& x, const Tensor& w,
                                          const std::vector<int64_t>& counts));
MT_CUDA_KERNEL(void grouped_linear_backward(Tensor& dx, Tensor& dw, const Tensor& dy, const Tensor& x,
                                           const Tensor& w, const std::vector<int64_t>& counts));
}  // namespace cuda

}  // namespace moetrain
