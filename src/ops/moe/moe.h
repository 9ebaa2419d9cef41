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

// The same ops with the plan where the ids are (docs/cuda.md, "Host synchronisation"):
// on a GPU nothing of it reaches the host, so an MoE layer queues its experts
// without waiting for the router. Every shape is fixed at A = N·k rows, whatever
// the routing; rows past the kept ones are padding (a capacity drops assignments).
//
// plan_expert_rows: ids [N, k] i64 (the router's selection) -> on ids' device, the
// order of plan_experts (nn/moe.h: by expert, stably; over `capacity` (> 0) the
// later assignments of an expert dropped):
struct ExpertRows {
  Tensor counts;     // i64 [E + 1]: rows kept per expert, then the dropped assignments
  Tensor offsets;    // i64 [E + 1]: expert e's rows are [offsets[e], offsets[e + 1])
  Tensor row_token;  // i64 [A]: each row's token (padding rows, from offsets[E] on: token 0)
  Tensor slot_row;   // i64 [A]: each (token n, slot s)'s row at n·k + s; A when dropped
  bool may_drop = false;  // capacity > 0: some rows may be padding
};
ExpertRows plan_expert_rows(const Tensor& ids, int64_t num_experts, int64_t capacity = 0);

// rows [A, W]: z [N, W]'s row of each row's token. Backward: d z[n] = the sum of
// its kept slots' row gradients, in row order (index_select's order and bits).
Tensor moe_gather(const Tensor& z, const ExpertRows& plan);

// grouped_linear with the row ranges of `offsets` (ExpertRows::offsets): rows from
// offsets[E] on are padding, their outputs and gradients zero. bf16 on a GPU reads
// the offsets there (grouped_linear_offsets_on_device); elsewhere they are read on
// the host: pass them there once (offsets.to(kCpu), a wait on a GPU: f32 and f64
// runs, the accuracy reference) rather than once per product.
Tensor grouped_linear(const Tensor& x, const Tensor& w, const Tensor& offsets);
// Whether grouped_linear on offsets reads them on x's device (the tensor-core path).
bool grouped_linear_offsets_on_device(const Tensor& x, const Tensor& w);
// bf16 on a GPU: the tensor-core kernels (the default), or false: the offsets read
// on the host and cuBLAS's grouped GEMM (a comparison, a fallback). The
// environment's MOETRAIN_GROUPED_GEMM=cublas sets false at the first use.
void set_grouped_gemm_tensor_cores(bool on);

// moe_combine with the plan's slot rows (on rows' device).
Tensor moe_combine(const Tensor& rows, const ExpertRows& plan, const Tensor& weights);

}  // namespace moetrain
