#pragma once

#include "backend/cuda/runtime.h"
#include "core/tensor.h"

namespace moetrain {

namespace cpu {

// silu: y = silu(conv(x)) (conv_silu.h), else y = conv(x).
void causal_conv1d_forward(Tensor& y, const Tensor& x, const Tensor& w, bool silu);
// dx[s] = Σ_i w_i g[s+W-1-i];  dw_i = Σ_{b,t} g[t] x[t-W+1+i]  (overwrites both), where
// g = dy, or with silu g = dy silu'(conv(x)) (the conv recomputed).
void causal_conv1d_backward(Tensor* grad_x, Tensor* grad_w, const Tensor& grad_y, const Tensor& x,
                            const Tensor& w, bool silu);

}  // namespace cpu

// The CUDA twins (conv_cuda.cu): same contracts; up to 16 taps.
namespace cuda {
MT_CUDA_KERNEL(void causal_conv1d_forward(Tensor& y, const Tensor& x, const Tensor& w, bool silu));
MT_CUDA_KERNEL(void causal_conv1d_backward(Tensor* grad_x, Tensor* grad_w, const Tensor& grad_y, const Tensor& x,
                                           const Tensor& w, bool silu));
}  // namespace cuda

}  // namespace moetrain
