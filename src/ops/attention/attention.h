// Causal softmax attention per head (docs/model.md#gpt-2-block, and
// docs/model.md#gated-mla for MLA):
//   o[t] = Σ_{s ≤ t} softmax_s(scale · q[t]·k[s]) v[s]
// Memory-efficient: query rows are processed in tiles of 64, so at most one
// [64, T] score block per thread exists at a time (never [T, T] for all heads);
// forward saves only the per-row log-sum-exp and backward recomputes the scores.
// The max-logit overload also gives QK-Clip's statistic (docs/model.md#qk-clip):
// the kernels keep the row maxima that their log-sum-exp subtracts, and the op
// reduces them per head.
#pragma once

#include "core/tensor.h"

namespace moetrain {

// q [B, T, H, Dk], k [B, Tk, H, Dk], v [B, Tk, H, Dv] -> o [B, T, H, Dv], Tk >= T.
// Query row t sits at position Tk - T + t and sees keys 0..Tk-T+t: Tk = T in
// training; Tk = cache length + T when decoding with a KV cache. scale is
// usually Dk^-1/2.
Tensor causal_attention(const Tensor& q, const Tensor& k, const Tensor& v, double scale);
// As above; with max_logit non-null also sets *max_logit to [H], head h's largest
// logit max over b, t and the causal keys s <= Tk - T + t of scale·q[b,t,h]·k[b,s,h]
// (the pre-softmax value; -inf for a head with no query row, T = 0). Taken from
// the pass that computes the log-sum-exp (the online softmax's running row max),
// so no score is recomputed. f32 for bf16 q, else q's dtype; on q's device; no
// gradient. A null max_logit costs nothing beyond the 4-argument call.
Tensor causal_attention(const Tensor& q, const Tensor& k, const Tensor& v, double scale, Tensor* max_logit);

}  // namespace moetrain
