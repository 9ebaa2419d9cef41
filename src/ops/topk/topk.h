// Top-k over the last dim (MoE router selection, sampling).
#pragma once

#include "core/tensor.h"

namespace moetrain {

struct TopK {
  Tensor values;   // [..., k], descending; differentiable
  Tensor indices;  // [..., k] i64; among equal values the lower index comes first
};

// NaN ranks above every number (so a NaN logit is never silently skipped).
TopK topk(const Tensor& x, int64_t k);

}  // namespace moetrain
