// Matrix products through BLAS.
#pragma once

#include "core/tensor.h"

namespace moetrain {

// op(a) op(b), op(x) = x or its transpose over the last two dims.
//   a [..., M, K] ([..., K, M] with trans_a), b [..., K, N] ([..., N, K] with trans_b)
// Leading dims: equal on both sides (batched), or one operand is rank 2 and is
// shared by every leading index of the other. -> [..., M, N].
// A rank-2 b with an untransposed a is one GEMM over all rows of a.
Tensor matmul(const Tensor& a, const Tensor& b, bool trans_a = false, bool trans_b = false);

// x W^T + bias: x [..., in], weight [out, in] (PyTorch nn.Linear layout), bias [out] or undefined.
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias = {});

}  // namespace moetrain
