// Normalisations over the last dim (docs/model.md#norms). Statistics are computed in
// double and saved in the input's dtype for backward.
#pragma once

#include "core/tensor.h"

namespace moetrain {

// GPT-2 LayerNorm: y = w * (x - mean) / sqrt(var + eps) + b, biased variance.
Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps = 1e-5);
// RMSNorm: y = w * x / sqrt(mean(x^2) + eps); weight may be undefined (no scale).
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps = 1e-5);
// Gated RMSNorm (KDA's output, fla's FusedRMSNormGated with sigmoid):
// y = rms_norm(x, weight) ⊙ σ(gate), one kernel; gate has x's shape.
Tensor gated_rms_norm(const Tensor& x, const Tensor& weight, const Tensor& gate, double eps = 1e-5);
// L2 norm (KDA q/k): y = x / sqrt(sum(x^2) + eps), eps inside the sqrt, not scaled by the dim.
Tensor l2_norm(const Tensor& x, double eps = 1e-6);

}  // namespace moetrain
