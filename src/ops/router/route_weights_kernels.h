// The kernels of renormalize_rows (ops/router/route_weights.h): the CPU's in
// route_weights_cpu.cpp, the GPU's in route_weights_cuda.cu, one row's arithmetic
// in route_weights_simt.h. Rows of k contiguous weights; both overwrite their output.
#pragma once

#include "backend/cuda/runtime.h"
#include "core/tensor.h"

namespace moetrain::cpu {
// y = w / (Σ_row w + eps), per row of k = w.size(-1).
void renormalize_rows_forward(Tensor& y, const Tensor& w, double eps);
// grad_w = (grad_y - Σ_row grad_y y) / (Σ_row w + eps).
void renormalize_rows_backward(Tensor& grad_w, const Tensor& grad_y, const Tensor& w, double eps);
}  // namespace moetrain::cpu

namespace moetrain::cuda {
MT_CUDA_KERNEL(void renormalize_rows_forward(Tensor& y, const Tensor& w, double eps));
MT_CUDA_KERNEL(void renormalize_rows_backward(Tensor& grad_w, const Tensor& grad_y, const Tensor& w, double eps));
}  // namespace moetrain::cuda
