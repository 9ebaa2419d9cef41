#pragma once

#include "backend/cuda/runtime.h"
#include "core/tensor.h"

namespace moetrain::cpu {

// lambda <= 0: no cap on `up`.
void situ_glu_forward(Tensor& out, const Tensor& gate, const Tensor& up, double beta, double lambda);
// Overwrites grad_gate and grad_up; *grad_beta (if not null) receives Σ dout ⊙ u ⊙ ∂a/∂β.
void situ_glu_backward(Tensor& grad_gate, Tensor& grad_up, double* grad_beta, const Tensor& grad_out,
                       const Tensor& gate, const Tensor& up, double beta, double lambda);

}  // namespace moetrain::cpu

namespace moetrain::cuda {

MT_CUDA_KERNEL(void situ_glu_forward(Tensor& out, const Tensor& gate, const Tensor& up, double beta, double lambda));
// As the CPU kernel, but *grad_beta (if not null) is a one-element tensor on the
// device, of gate's dtype, that receives Σ dout ⊙ u ⊙ ∂a/∂β (overwritten).
MT_CUDA_KERNEL(void situ_glu_backward(Tensor& grad_gate, Tensor& grad_up, Tensor* grad_beta, const Tensor& grad_out,
                                      const Tensor& gate, const Tensor& up, double beta, double lambda));

}  // namespace moetrain::cuda
