// Causal softmax attention per head (docs/model.md#gpt-2-block, and
// docs/model.md#gated-mla for MLA):
//   o[t] = Σ_{s ≤ t} softmax_s(scale · q[t]·k[s]) v[s]
// Memory-efficient: query rows are processed in tiles of 64, so at most one
// [64, T] score block per thread exists at a time (never [T, T] for all heads);
// forward saves only the per-row log-sum-exp and backward recomputes the scores.
#pragma once

#include "core/tensor.h"

namespace moetrain {

// q [B, T, H, Dk], k [B, Tk, H, Dk], v [B, Tk, H, Dv] -> o [B, T, H, Dv], Tk >= T.
// Query row t sits at position Tk - T + t and sees keys 0..Tk-T+t: Tk = T in
// training; Tk = cache length + T when decoding with a KV cache. scale is
// usually Dk^-1/2.
Tensor causal_attention(const Tensor& q, const Tensor& k, const Tensor& v, double scale);

}  // namespace moetrain
