#pragma once

#include "backend/cuda/runtime.h"
#include "core/tensor.h"

namespace moetrain {

// What follows the bias in linear_forward: nothing, or GPT-2's tanh GELU.
enum class Activation { none, gelu_tanh };

namespace cpu {

// out = op(a) op(b) for the layouts documented in linalg.h; out is [..., M, N].
void matmul_forward(Tensor& out, const Tensor& a, const Tensor& b, bool trans_a, bool trans_b);

// Over the R rows of x [..., in] with w [out, in], b [out], y [..., out]:
//   none:      y = x w^T + b                      (z unused)
//   gelu_tanh: z = x w^T + b, y = gelu_tanh(z)    (z, the pre-activation, is kept for backward)
void linear_forward(Tensor& y, Tensor& z, const Tensor& x, const Tensor& w, const Tensor& b, Activation act);
// Given grad_y: grad_z = grad_y (none) or grad_y gelu_tanh'(z); grad_b = Σ_rows grad_z,
// grad_w = grad_z^T x, grad_x = grad_z w. Overwrites each output that is defined;
// undefined ones are not computed.
void linear_backward(Tensor& grad_x, Tensor& grad_w, Tensor& grad_b, const Tensor& grad_y, const Tensor& x,
                     const Tensor& w, const Tensor& z, Activation act);
// The input gradient of a linear layer (w [out, in], grad_y [..., out]) whose input
// was gelu_tanh(z), z [..., in], carried through the GELU: grad_z = (grad_y w)
// gelu_tanh'(z), and grad_b = Σ_rows grad_z (the bias gradient of the layer that
// made z) when defined. Overwrites both.
void gelu_input_backward(Tensor& grad_z, Tensor& grad_b, const Tensor& grad_y, const Tensor& w, const Tensor& z);

}  // namespace cpu

// The CUDA twin (linalg_cuda.cu, cuBLAS).
namespace cuda {
MT_CUDA_KERNEL(void matmul_forward(Tensor& out, const Tensor& a, const Tensor& b, bool trans_a, bool trans_b));
// cuBLASLt with the bias / bias + GELU epilogues, the bias gradient from the
// weight-gradient GEMM (BGRADB); plain cuBLAS and the elementwise kernels where
// cuBLASLt refuses (linalg_cuda.cu, docs/cuda.md "cuBLASLt epilogues").
MT_CUDA_KERNEL(void linear_forward(Tensor& y, Tensor& z, const Tensor& x, const Tensor& w, const Tensor& b,
                                   Activation act));
MT_CUDA_KERNEL(void linear_backward(Tensor& grad_x, Tensor& grad_w, Tensor& grad_b, const Tensor& grad_y,
                                    const Tensor& x, const Tensor& w, const Tensor& z, Activation act));
// cuBLASLt's DGELU_BGRAD on the GEMM grad_y w.
MT_CUDA_KERNEL(void gelu_input_backward(Tensor& grad_z, Tensor& grad_b, const Tensor& grad_y, const Tensor& w,
                                        const Tensor& z));
}  // namespace cuda

}  // namespace moetrain
