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
// With a bias it is one op: on CUDA one cuBLASLt GEMM with the bias epilogue, the
// bias gradient from the weight-gradient GEMM (docs/cuda.md, "cuBLASLt epilogues").
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias = {});

// gelu_tanh(x W^T + bias), GPT-2's MLP up-projection as one op (bias required):
// the same values as gelu_tanh(linear(x, weight, bias)), on the CPU the same bits.
// Keeps the pre-activation for backward, not the output; on CUDA the GEMM's
// GELU_AUX_BIAS epilogue writes both.
Tensor linear_gelu(const Tensor& x, const Tensor& weight, const Tensor& bias);

// linear(linear_gelu(x, w_fc, b_fc), w_proj, b_proj): GPT-2's MLP as one op, so
// that its backward can carry the projection's input gradient through the GELU in
// the same GEMM (on CUDA cuBLASLt's DGELU_BGRAD, which also gives b_fc's gradient).
// w_fc [F, D], w_proj [D_out, F]. The same values as the two ops, on the CPU the
// same bits; keeps what they keep (x, z = the pre-activation, gelu(z), weights).
Tensor mlp_gelu(const Tensor& x, const Tensor& w_fc, const Tensor& b_fc, const Tensor& w_proj, const Tensor& b_proj);

}  // namespace moetrain
