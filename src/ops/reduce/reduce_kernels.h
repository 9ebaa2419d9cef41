#pragma once

#include "backend/cuda/runtime.h"
#include "core/tensor.h"

namespace moetrain::cpu {

// x viewed as [outer, n, inner]; out as [outer, inner].
void sum_dim(Tensor& out, const Tensor& x, int64_t outer, int64_t n, int64_t inner);
void sum_all(Tensor& out, const Tensor& x);
void max_dim(Tensor& values, Tensor& indices, const Tensor& x, int64_t outer, int64_t n, int64_t inner);
// grad_x[o, indices[o, j], j] = grad[o, j]; grad_x must be zero on entry.
void max_dim_backward(Tensor& grad_x, const Tensor& grad, const Tensor& indices, int64_t outer, int64_t n,
                      int64_t inner);
// NaN and +-inf elements of a floating tensor (f32, f64, bf16).
int64_t count_non_finite(const Tensor& x);

}  // namespace moetrain::cpu

namespace moetrain::cuda {

MT_CUDA_KERNEL(void sum_dim(Tensor& out, const Tensor& x, int64_t outer, int64_t n, int64_t inner));
MT_CUDA_KERNEL(void sum_all(Tensor& out, const Tensor& x));
MT_CUDA_KERNEL(void max_dim(Tensor& values, Tensor& indices, const Tensor& x, int64_t outer, int64_t n,
                            int64_t inner));
MT_CUDA_KERNEL(void max_dim_backward(Tensor& grad_x, const Tensor& grad, const Tensor& indices, int64_t outer,
                                     int64_t n, int64_t inner));

}  // namespace moetrain::cuda
