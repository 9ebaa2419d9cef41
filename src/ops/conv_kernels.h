#pragma once

#include "core/tensor.h"

namespace moetrain::cpu {

void causal_conv1d_forward(Tensor& y, const Tensor& x, const Tensor& w);
// dx[s] = Σ_i w_i dy[s+W-1-i];  dw_i = Σ_{b,t} dy[t] x[t-W+1+i]  (overwrites both).
void causal_conv1d_backward(Tensor* grad_x, Tensor* grad_w, const Tensor& grad_y, const Tensor& x,
                            const Tensor& w);

}  // namespace moetrain::cpu
