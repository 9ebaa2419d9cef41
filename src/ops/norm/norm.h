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

// A residual add and the norm of its result in one op: sum = x + delta, normed =
// norm(sum) (docs/model.md#gpt-2-block: h = x + attn, then LN_2(h)). The same values
// as add then layer_norm / rms_norm (on the CPU the same bits); backward is one
// kernel too: the gradient of x and of delta is grad_sum + the norm's input
// gradient. delta has x's shape.
struct ResidualNorm {
  Tensor sum;     // x + delta
  Tensor normed;  // norm(sum)
};
ResidualNorm add_layer_norm(const Tensor& x, const Tensor& delta, const Tensor& weight, const Tensor& bias,
                            double eps = 1e-5);
ResidualNorm add_rms_norm(const Tensor& x, const Tensor& delta, const Tensor& weight, double eps = 1e-5);

}  // namespace moetrain
