#pragma once

#include "backend/cuda/runtime.h"
#include "core/tensor.h"

namespace moetrain::cpu {

// x viewed as [rows, n].
void softmax_forward(Tensor& y, const Tensor& x, bool log);
// softmax: dx = y (dy - Σ dy y);  log_softmax: dx = dy - e^y Σ dy.
void softmax_backward(Tensor& grad_x, const Tensor& grad_y, const Tensor& y, bool log);
// Per row n (lse is f64): lse[n] = log Σ_v e^{logits[n, v]}, loss_sum = Σ_counted (lse - logit[target]).
void cross_entropy_forward(Tensor& lse, double& loss_sum, int64_t& count, const Tensor& logits,
                           const Tensor& targets, int64_t ignore_index);
// grad_logits[n, :] = scale (softmax(logits[n]) - onehot(target)) for counted rows, 0 otherwise.
void cross_entropy_backward(Tensor& grad_logits, const Tensor& logits, const Tensor& targets, const Tensor& lse,
                            double scale, int64_t ignore_index);

}  // namespace moetrain::cpu

namespace moetrain::cuda {

MT_CUDA_KERNEL(void softmax_forward(Tensor& y, const Tensor& x, bool log));
MT_CUDA_KERNEL(void softmax_backward(Tensor& grad_x, const Tensor& grad_y, const Tensor& y, bool log));
// As the CPU kernels, with the reductions left on the device: loss (a 0-dim
// tensor of the logits' dtype) = Σ_counted (lse - logit[target]) / divisor, and
// backward's scale = grad_loss (0-dim, on the device) · inv_divisor.
MT_CUDA_KERNEL(void cross_entropy_forward(Tensor& lse, Tensor& loss, const Tensor& logits, const Tensor& targets,
                                          int64_t ignore_index, double divisor));
MT_CUDA_KERNEL(void cross_entropy_backward(Tensor& grad_logits, const Tensor& logits, const Tensor& targets,
                                           const Tensor& lse, const Tensor& grad_loss, double inv_divisor,
                                           int64_t ignore_index));

}  // namespace moetrain::cuda
