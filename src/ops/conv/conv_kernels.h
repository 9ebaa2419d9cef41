#pragma once

#include "backend/cuda/runtime.h"
#include "core/tensor.h"

namespace moetrain {

namespace cpu {

void causal_conv1d_forward(Tensor& y, const Tensor& x, const Tensor& w);
// dx[s] = Σ_i w_i dy[s+W-1-i];  dw_i = Σ_{b,t} dy[t] x[t-W+1+i]  (overwrites both).
void causal_conv1d_backward(Tensor* grad_x, Tensor* grad_w, const Tensor& grad_y, const Tensor& x,
                            const Tensor& w);

}  // namespace cpu

// The CUDA twins (conv_cuda.cu): same contracts; up to 16 taps.
namespace cuda {
MT_CUDA_KERNEL(void causal_conv1d_forward(Tensor& y, const Tensor& x, const Tensor& w));
MT_CUDA_KERNEL(void causal_conv1d_backward(Tensor* grad_x, Tensor* grad_w, const Tensor& grad_y, const Tensor& x,
                                           const Tensor& w));
}  // namespace cuda

}  // namespace moetrain
