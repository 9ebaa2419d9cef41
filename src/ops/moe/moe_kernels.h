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
// slot_rows: i64 [N * k] where rows lives; y [N, W] written; the rows of grad_rows [M, W]
// that a slot names and all of grad_weights [N, k] written (the op zeroes grad_rows when
// some row is named by no slot).
void moe_combine_forward(Tensor& y, const Tensor& rows, const Tensor& slot_rows, const Tensor& weights);
void moe_combine_backward(Tensor& grad_rows, Tensor& grad_weights, const Tensor& dy, const Tensor& rows,
                          const Tensor& slot_rows, const Tensor& weights);

}  // namespace cpu

// The CUDA twins (moe_cuda.cu: cuBLAS per expert; the combine's own kernels).
namespace cuda {
MT_CUDA_KERNEL(void grouped_linear_forward(Tensor& y, const Tensor& x, const Tensor& w,
                                          const std::vector<int64_t>& counts));
MT_CUDA_KERNEL(void grouped_linear_backward(Tensor& dx, Tensor& dw, const Tensor& dy, const Tensor& x,
                                           const Tensor& w, const std::vector<int64_t>& counts));
MT_CUDA_KERNEL(void moe_combine_forward(Tensor& y, const Tensor& rows, const Tensor& slot_rows,
                                       const Tensor& weights));
MT_CUDA_KERNEL(void moe_combine_backward(Tensor& grad_rows, Tensor& grad_weights, const Tensor& dy,
                                        const Tensor& rows, const Tensor& slot_rows, const Tensor& weights));
}  // namespace cuda

}  // namespace moetrain
