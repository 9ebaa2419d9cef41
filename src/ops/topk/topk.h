// Top-k over the last dim (MoE router selection, sampling), and the gather by
// per-row indices that reads what a selection picked (the router's weights).
#pragma once

#include "core/tensor.h"

namespace moetrain {

struct TopK {
  Tensor values;   // [..., k], descending; differentiable
  Tensor indices;  // [..., k] i64; among equal values the lower index comes first
};

// NaN ranks above every number (so a NaN logit is never silently skipped).
TopK topk(const Tensor& x, int64_t k);

// The entries of x at per-row indices: out[..., j] = x[..., index[..., j]] for x
// [..., n] and index [..., k] (i64, the same leading dims, on x's device). The
// gradient adds each entry's gradient back at its index (a repeated index sums,
// in j order). Host indices outside [0, n) are an error naming the first. CUDA
// indices are not read on the host (no wait for the GPU; the router's come from
// its selection kernel): an entry outside [0, n) reads as NaN and passes no gradient.
Tensor gather_last(const Tensor& x, const Tensor& index);

// How often each of n values occurs in each row of index [..., k] (i64, values in
// [0, n); CUDA indices are not read on the host): counts [..., n] in `dtype`, no
// gradient. The router's expert load per token, where the ids are.
Tensor index_counts(const Tensor& index, int64_t n, DType dtype);

}  // namespace moetrain
