// The router's renormalisation of its top-k weights (docs/model.md#moe-router,
// moe.renormalize) as one op: per row of w [..., k],
//   y_j = w_j / (S + eps),  S = Σ_j w_j,
// where div(w, add_scalar(sum(w, -1, true), eps)) launched three kernels forward
// and, with the gradient's broadcast, the sum over the row and the accumulation
// of w's two uses, seven backward (docs/cuda.md, "The launch path and the launch
// counter"); this is one each. Backward: grad_w_j = (grad_y_j - Σ_i grad_y_i y_i) / (S + eps).
// S is summed in the compute type (f32 for bf16, f64 for f64) in slot order
// (route_weights_simt.h: the same arithmetic on the CPU and the GPU).
#pragma once

#include "core/tensor.h"

namespace moetrain {

Tensor renormalize_rows(const Tensor& w, double eps);

}  // namespace moetrain
