#pragma once

#include "backend/cuda/runtime.h"
#include "core/tensor.h"

namespace moetrain::cpu {

void topk_forward(Tensor& values, Tensor& indices, const Tensor& x, int64_t k);
// out[r, j] = x[r, index[r, j]] (indices checked by the op).
void gather_last_forward(Tensor& out, const Tensor& x, const Tensor& index);
// grad_x = 0, then grad_x[r, indices[r, j]] += grad[r, j] for j = 0, 1, ... in
// order (topk's and gather_last's backward).
void scatter_last(Tensor& grad_x, const Tensor& grad, const Tensor& indices);

}  // namespace moetrain::cpu

namespace moetrain::cuda {

MT_CUDA_KERNEL(void topk_forward(Tensor& values, Tensor& indices, const Tensor& x, int64_t k));
// As the CPU's; an index outside [0, n) gives NaN (forward) and is skipped (scatter).
MT_CUDA_KERNEL(void gather_last_forward(Tensor& out, const Tensor& x, const Tensor& index));
MT_CUDA_KERNEL(void scatter_last(Tensor& grad_x, const Tensor& grad, const Tensor& indices));

}  // namespace moetrain::cuda
