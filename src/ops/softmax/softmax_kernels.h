#pragma once

#include "backend/cuda/runtime.h"
#include "core/tensor.h"

namespace moetrain::cpu {

// x viewed as [rows, n].
void softmax_forward(Tensor& y, const Tensor& x, bool log);
// softmax: dx = y (dy - Σ dy y);  log_softmax: dx = dy - e^y Σ dy.
void softmax_backward(Tensor& grad_x, const Tensor& grad_y, const Tensor& y, bool log);
// Logits [rows, V] of which the first num_classes columns are classes (the rest:
// padding, outside the softmax). Per row n (lse is f64):
// lse[n] = log Σ_{v < num_classes} e^{logits[n, v]}, loss_sum = Σ_counted (lse - logit[target]).
void cross_entropy_forward(Tensor& lse, double& loss_sum, int64_t& count, const Tensor& logits,
                           const Tensor& targets, int64_t ignore_index, int64_t num_classes);
// grad_logits[n, :] = scale (softmax(logits[n]) - onehot(target)) over the classes
// of counted rows, 0 otherwise (ignored rows, padding columns).
void cross_entropy_backward(Tensor& grad_logits, const Tensor& logits, const Tensor& targets, const Tensor& lse,
                            double scale, int64_t ignore_index, int64_t num_classes);

}  // namespace moetrain::cpu

namespace moetrain::cuda {

MT_CUDA_KERNEL(void softmax_forward(Tensor& y, const Tensor& x, bool log));
MT_CUDA_KERNEL(void softmax_backward(Tensor& grad_x, const Tensor& grad_y, const Tensor& y, bool log));
// As the CPU kernels (bf16 logits too), with the reductions left on the device and
// no host read: counted (0-dim f64) = rows whose target is not ignore_index; loss
// (0-dim, f32 for f32 and bf16 logits, f64 for f64) = Σ_counted (lse - logit[target])
// / divisor, divisor = max(counted, 1) for the mean, 1 for the sum; backward's
// scale = grad_loss (0-dim, the loss's dtype, on the device) / divisor. grad_logits
// has the logits' dtype (bf16: each element computed in f32 and rounded once). A
// target outside [0, num_classes) other than ignore_index gives NaN (its row loss
// and gradient row): device targets are not range-checked. The bodies:
// ops/softmax/cross_entropy_simt.h.
MT_CUDA_KERNEL(void cross_entropy_forward(Tensor& lse, Tensor& loss, Tensor& counted, const Tensor& logits,
                                          const Tensor& targets, int64_t ignore_index, int64_t num_classes,
                                          bool mean));
MT_CUDA_KERNEL(void cross_entropy_backward(Tensor& grad_logits, const Tensor& logits, const Tensor& targets,
                                           const Tensor& lse, const Tensor& grad_loss, const Tensor& counted,
                                           bool mean, int64_t ignore_index, int64_t num_classes));

}  // namespace moetrain::cuda
