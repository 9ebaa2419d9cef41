// The KDA decay gate (docs/model.md#decay-gate, fla's fused KDA gate), one
// kernel instead of five elementwise ops:
//   no lower bound (Kimi-Linear):  g = -exp(A_log[h]) · softplus(f + dt_bias[h, :])
//   lower bound lb (K3 "safe gate"): g = lb · σ(exp(A_log[h]) · (f + dt_bias[h, :]))
// f is [..., H, K], A_log [H], dt_bias [H·K] (indexed h·K + d); g has f's shape.
// Gated DeltaNet's per-head gate is the K = 1 case (f [..., H, 1], dt_bias [H]).
#pragma once

#include <optional>

#include "core/tensor.h"

namespace moetrain {

Tensor decay_gate(const Tensor& f, const Tensor& A_log, const Tensor& dt_bias, std::optional<double> lower_bound);

}  // namespace moetrain
