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
// only the per-row log-sum-exp (f64); backward forms softmax - onehot row by row,
// so no [rows, V] probability tensor is stored.
// num_classes (default: V): only the first num_classes columns are classes; the
// rest (a padded vocabulary's padding, docs/model.md#padded-vocabulary) are outside
// the softmax, get gradient 0, and are no valid target.
// Dtypes: logits f32 or f64 (CPU and CUDA) or bf16 (CUDA). The loss is a 0-dim
// tensor in the arithmetic's dtype: f64 for f64 logits, f32 for f32 and bf16
// (a bf16 run's logged loss keeps f32's digits, docs/cuda.md#mixed-precision);
// the gradient has the logits' dtype (bf16: computed in f32, rounded once).
// Targets: on the host (CPU logits) they are range-checked, an Error naming the
// position, the value and the range. On CUDA they are not read on the host (no
// wait for the GPU on the training step); a target outside [0, num_classes) other
// than ignore_index gives a NaN loss and NaN gradient row instead: check them where
// they are made (the data loader does, at open; LanguageModel::loss checks host
// targets before it moves them) with check_cross_entropy_targets.
Tensor cross_entropy(const Tensor& logits, const Tensor& targets, int64_t ignore_index = -100,
                     Reduction reduction = Reduction::mean, int64_t num_classes = -1);

// Host targets (i32 or i64) against [0, num_classes) or ignore_index: an Error
// naming the first bad one (padding > 0: the message says the logits have that many
// padding columns). Returns the rows whose target is not ignore_index.
int64_t check_cross_entropy_targets(const Tensor& targets, int64_t num_classes, int64_t ignore_index = -100,
                                    int64_t padding = 0);

}  // namespace moetrain
