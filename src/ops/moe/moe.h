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

// The combine step of an MoE layer (docs/model.md#moe): rows [M, W] are the experts'
// outputs in expert order, slot_rows [N * k] gives for each (token n, slot s) the row
// that holds its output (M for a dropped slot: it adds nothing), weights [N, k] the
// routing weights (rows' dtype); each row is named by at most one slot. Returns y [N, W] with
//   y[n] = sum over s = 0..k-1 of weights[n, s] * rows[slot_rows[n k + s]],
// summed in slot order. Backward: d rows[slot_rows[n k + s]] = weights[n, s] * dy[n]
// (rows no slot names get zero), d weights[n, s] = <rows[slot_rows[n k + s]], dy[n]>
// (zero for a dropped slot). One pass each way: the gather, the weighting and the sum
// over slots without the [N, k, W] intermediates of index_select, mul and sum.
Tensor moe_combine(const Tensor& rows, const std::vector<int64_t>& slot_rows, const Tensor& weights);

}  // namespace moetrain
