#pragma once

#include <vector>

#include "core/tensor.h"

namespace moetrain::cpu {

// h [N, D] (as the sources' shape); alpha, rstd: [N, M] (saved for backward).
void attn_res_forward(Tensor& h, Tensor& alpha, Tensor& rstd, const std::vector<const Tensor*>& sources,
                      const Tensor& proj, const Tensor& norm, double eps);
// grad_sources[m] (undefined: not needed), grad_proj, grad_norm (null: not needed); all overwritten.
void attn_res_backward(std::vector<Tensor>& grad_sources, Tensor* grad_proj, Tensor* grad_norm,
                       const Tensor& grad_h, const std::vector<const Tensor*>& sources, const Tensor& proj,
                       const Tensor& norm, const Tensor& alpha, const Tensor& rstd);

}  // namespace moetrain::cpu
