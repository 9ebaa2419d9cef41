// Expert compute for MoE layers (docs/model.md#moe-experts): rows sorted by expert, each
// expert's rows run as one GEMM.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace moetrain {

// x [M, in] whose rows are grouped by expert: rows [o_e, o_e + counts[e]) with
// o_e = counts[0] + ... + counts[e-1] belong to expert e; w [E, out, in].
// Returns y [M, out] with y_rows(e) = x_rows(e) w[e]^T: one GEMM per expert with
// rows (none for an expert without rows). Backward: dx_rows(e) = dy_rows(e) w[e],
// dw[e] = dy_rows(e)^T x_rows(e) (zero for an expert without rows).
Tensor grouped_linear(const Tensor& x, const Tensor& w, const std::vector<int64_t>& counts);

}  // namespace moetrain
