// Token embedding: a gather of rows. Backward scatter-adds into the table.
#pragma once

#include "core/tensor.h"

namespace moetrain {

// weight [V, D], ids [...] (i32, i64 or u16) -> [..., D]. Host ids outside [0, V)
// throw. Ids on the CUDA device of a CUDA table are not read on the host: one
// outside [0, V) gives a NaN row (and adds nothing to the table's gradient).
Tensor embedding(const Tensor& weight, const Tensor& ids);

}  // namespace moetrain
