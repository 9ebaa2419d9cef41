#pragma once

#include "backend/cuda/runtime.h"
#include "core/tensor.h"

namespace moetrain::cpu {

void topk_forward(Tensor& values, Tensor& indices, const Tensor& x, int64_t k);
// grad_x[r, indices[r, j]] = grad[r, j]; grad_x zero elsewhere (overwritten).
void topk_backward(Tensor& grad_x, const Tensor& grad, const Tensor& indices);

}  // namespace moetrain::cpu

namespace moetrain::cuda {

MT_CUDA_KERNEL(void topk_forward(Tensor& values, Tensor& indices, const Tensor& x, int64_t k));
MT_CUDA_KERNEL(void topk_backward(Tensor& grad_x, const Tensor& grad, const Tensor& indices));

}  // namespace moetrain::cuda
