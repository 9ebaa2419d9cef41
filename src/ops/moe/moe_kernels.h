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

// The expert plan (moe_plan_simt.h; ops/moe/moe.h, plan_expert_rows): ids i64 [A = N·k]
// in; counts, offsets i64 [E + 1], row_token, slot_row i64 [A] written.
void plan_expert_rows(Tensor& counts, Tensor& offsets, Tensor& row_token, Tensor& slot_row, const Tensor& ids,
                      int64_t k, int64_t capacity);
// rows [M, W] = z [N, W] at row_token [M]; grad_z [N, W] written (each token's slots' rows summed).
void moe_gather_forward(Tensor& rows, const Tensor& z, const Tensor& row_token);
void moe_gather_backward(Tensor& grad_z, const Tensor& grad_rows, const Tensor& slot_row);

}  // namespace cpu

// The CUDA twins (moe_cuda.cu: cuBLAS per expert; the combine's own kernels; moe_plan_cuda.cu).
namespace cuda {
MT_CUDA_KERNEL(void grouped_linear_forward(Tensor& y, const Tensor& x, const Tensor& w,
                                          const std::vector<int64_t>& counts));
MT_CUDA_KERNEL(void grouped_linear_backward(Tensor& dx, Tensor& dw, const Tensor& dy, const Tensor& x,
                                           const Tensor& w, const std::vector<int64_t>& counts));
MT_CUDA_KERNEL(void moe_combine_forward(Tensor& y, const Tensor& rows, const Tensor& slot_rows,
                                       const Tensor& weights));
MT_CUDA_KERNEL(void moe_combine_backward(Tensor& grad_rows, Tensor& grad_weights, const Tensor& dy,
                                        const Tensor& rows, const Tensor& slot_rows, const Tensor& weights));
MT_CUDA_KERNEL(void plan_expert_rows(Tensor& counts, Tensor& offsets, Tensor& row_token, Tensor& slot_row,
                                    const Tensor& ids, int64_t k, int64_t capacity));
MT_CUDA_KERNEL(void moe_gather_forward(Tensor& rows, const Tensor& z, const Tensor& row_token));
MT_CUDA_KERNEL(void moe_gather_backward(Tensor& grad_z, const Tensor& grad_rows, const Tensor& slot_row));
}  // namespace cuda

}  // namespace moetrain
