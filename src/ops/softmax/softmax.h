// Softmax family over the last dim, computed max-subtracted (no overflow), and
// the fused cross-entropy loss.
#pragma once

#include "core/tensor.h"

namespace moetrain {

Tensor softmax(const Tensor& x);
Tensor log_softmax(const Tensor& x);

enum class Reduction { mean, sum };

// Cross-entropy of logits [..., V] against integer targets [...] (i32 or i64).
// Rows whose target is ignore_index contribute nothing; `mean` divides by the
// number of counted rows (0 when every row is ignored). Fused: forward keeps
// only the per-row log-sum-exp; backward forms softmax - onehot row by row, so no
// [rows, V] probability tensor is stored.
Tensor cross_entropy(const Tensor& logits, const Tensor& targets, int64_t ignore_index = -100,
                     Reduction reduction = Reduction::mean);

}  // namespace moetrain
