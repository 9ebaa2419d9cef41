// Kernels of the decay gate (ops/kda/decay_gate.h); lower_bound == 0: the softplus
// gate. Backward overwrites grad_f = dg ∂g/∂f and, where given, grad_a = dg ∂g/∂A_log
// per element (f's shape; the op sums it over all but the head); g is the
// forward's output (the softplus gate's ∂g/∂A_log is g itself).
#pragma once

#include "backend/cuda/runtime.h"
#include "core/tensor.h"

namespace moetrain::cpu {

void decay_gate_forward(Tensor& g, const Tensor& f, const Tensor& A_log, const Tensor& dt_bias, double lower_bound);
void decay_gate_backward(Tensor& grad_f, Tensor* grad_a, const Tensor& grad_g, const Tensor& g, const Tensor& f,
                         const Tensor& A_log, const Tensor& dt_bias, double lower_bound);

}  // namespace moetrain::cpu

namespace moetrain::cuda {

MT_CUDA_KERNEL(void decay_gate_forward(Tensor& g, const Tensor& f, const Tensor& A_log, const Tensor& dt_bias,
                                       double lower_bound));
MT_CUDA_KERNEL(void decay_gate_backward(Tensor& grad_f, Tensor* grad_a, const Tensor& grad_g, const Tensor& g,
                                        const Tensor& f, const Tensor& A_log, const Tensor& dt_bias,
                                        double lower_bound));

}  // namespace moetrain::cuda
