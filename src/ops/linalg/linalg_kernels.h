#pragma once

#include "backend/cuda/runtime.h"
#include "core/tensor.h"

namespace moetrain {

namespace cpu {

// out = op(a) op(b) for the layouts documented in linalg.h; out is [..., M, N].
void matmul_forward(Tensor& out, const Tensor& a, const Tensor& b, bool trans_a, bool trans_b);

}  // namespace cpu

// The CUDA twin (linalg_cuda.cu, cuBLAS).
namespace cuda {
MT_CUDA_KERNEL(void matmul_forward(Tensor& out, const Tensor& a, const Tensor& b, bool trans_a, bool trans_b));
}  // namespace cuda

}  // namespace moetrain
