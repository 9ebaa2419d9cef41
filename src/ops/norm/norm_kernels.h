// Kernels of the norm family; x viewed as [rows, n]. Backward overwrites
// grad_x and (where given) grad_w / grad_b. mean and rstd have x's dtype, except
// for bf16 x (CUDA only), whose statistics are f32.
#pragma once

#include "backend/cuda/runtime.h"
#include "core/tensor.h"

namespace moetrain::cpu {

void layer_norm_forward(Tensor& y, Tensor& mean, Tensor& rstd, const Tensor& x, const Tensor& w, const Tensor& b,
                        double eps);
void layer_norm_backward(Tensor& grad_x, Tensor* grad_w, Tensor* grad_b, const Tensor& grad_y, const Tensor& x,
                         const Tensor& w, const Tensor& mean, const Tensor& rstd);
// RMSNorm and L2 norm share a kernel: rstd = 1/sqrt(sum(x^2) * scale + eps)
// with scale = 1/n (RMSNorm) or 1 (L2 norm); w may be undefined. With a gate z
// (x's shape; undefined: none) y = x rstd w σ(z), and backward writes grad_z.
void scaled_norm_forward(Tensor& y, Tensor& rstd, const Tensor& x, const Tensor& w, const Tensor& z, double scale,
                         double eps);
void scaled_norm_backward(Tensor& grad_x, Tensor* grad_w, Tensor* grad_z, const Tensor& grad_y, const Tensor& x,
                          const Tensor& w, const Tensor& z, const Tensor& rstd, double scale);
// The fused residual add + norm (add_layer_norm, add_rms_norm): h = x + d in T,
// then the norm of h exactly as layer_norm_forward / scaled_norm_forward (no
// gate) compute it from h. Backward: grad_x = grad_h + the norm's input
// gradient at h (the gradient of x and of d alike); grad_w / grad_b as the norm's.
void add_layer_norm_forward(Tensor& h, Tensor& y, Tensor& mean, Tensor& rstd, const Tensor& x, const Tensor& d,
                            const Tensor& w, const Tensor& b, double eps);
void add_layer_norm_backward(Tensor& grad_x, Tensor* grad_w, Tensor* grad_b, const Tensor& grad_h,
                             const Tensor& grad_y, const Tensor& h, const Tensor& w, const Tensor& mean,
                             const Tensor& rstd);
void add_scaled_norm_forward(Tensor& h, Tensor& y, Tensor& rstd, const Tensor& x, const Tensor& d, const Tensor& w,
                             double scale, double eps);
void add_scaled_norm_backward(Tensor& grad_x, Tensor* grad_w, const Tensor& grad_h, const Tensor& grad_y,
                              const Tensor& h, const Tensor& w, const Tensor& rstd, double scale);

}  // namespace moetrain::cpu

namespace moetrain::cuda {

MT_CUDA_KERNEL(void layer_norm_forward(Tensor& y, Tensor& mean, Tensor& rstd, const Tensor& x, const Tensor& w,
                                       const Tensor& b, double eps));
MT_CUDA_KERNEL(void layer_norm_backward(Tensor& grad_x, Tensor* grad_w, Tensor* grad_b, const Tensor& grad_y,
                                        const Tensor& x, const Tensor& w, const Tensor& mean, const Tensor& rstd));
MT_CUDA_KERNEL(void scaled_norm_forward(Tensor& y, Tensor& rstd, const Tensor& x, const Tensor& w, const Tensor& z,
                                        double scale, double eps));
MT_CUDA_KERNEL(void scaled_norm_backward(Tensor& grad_x, Tensor* grad_w, Tensor* grad_z, const Tensor& grad_y,
                                         const Tensor& x, const Tensor& w, const Tensor& z, const Tensor& rstd,
                                         double scale));
// The fused residual add + norm: the bodies of ops/norm/norm_simt.h, one block per
// row; the statistics and the row sums in acc_t (f32 for bf16), grad_x rounded once.
MT_CUDA_KERNEL(void add_layer_norm_forward(Tensor& h, Tensor& y, Tensor& mean, Tensor& rstd, const Tensor& x,
                                           const Tensor& d, const Tensor& w, const Tensor& b, double eps));
MT_CUDA_KERNEL(void add_layer_norm_backward(Tensor& grad_x, Tensor* grad_w, Tensor* grad_b, const Tensor& grad_h,
                                            const Tensor& grad_y, const Tensor& h, const Tensor& w,
                                            const Tensor& mean, const Tensor& rstd));
MT_CUDA_KERNEL(void add_scaled_norm_forward(Tensor& h, Tensor& y, Tensor& rstd, const Tensor& x, const Tensor& d,
                                            const Tensor& w, double scale, double eps));
MT_CUDA_KERNEL(void add_scaled_norm_backward(Tensor& grad_x, Tensor* grad_w, const Tensor& grad_h,
                                             const Tensor& grad_y, const Tensor& h, const Tensor& w,
                                             const Tensor& rstd, double scale));

}  // namespace moetrain::cuda
