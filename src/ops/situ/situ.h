// SiTU-GLU activation (docs/model.md#situ-glu, K3 `SituAndMul`), fused:
//   a   = β · tanh(gate/β) · σ(gate)        soft-capped SiLU (→ silu as β → ∞)
//   u   = λ · tanh(up/λ)                     only when a linear β (λ) is given; else u = up
//   out = a ⊙ u
// The caller does the projections: gate = x W1^T, up = x W3^T, y = out W2^T.
#pragma once

#include <optional>

#include "core/tensor.h"

namespace moetrain {

// gate and up have the same shape; β and λ > 0 are constants.
Tensor situ_glu(const Tensor& gate, const Tensor& up, double beta, std::optional<double> linear_beta);
// Learnable β: `beta` is a one-element tensor (shape [] or [1]) of the inputs' dtype;
// its gradient is Σ dout ⊙ u ⊙ ∂a/∂β with ∂a/∂β = σ(g)(tanh(g/β) − (g/β)(1 − tanh²(g/β))).
Tensor situ_glu(const Tensor& gate, const Tensor& up, const Tensor& beta, std::optional<double> linear_beta);

}  // namespace moetrain
