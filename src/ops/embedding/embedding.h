// Token embedding: a gather of rows. Backward scatter-adds into the table.
#pragma once

#include "core/tensor.h"

namespace moetrain {

// weight [V, D], ids [...] (i32, i64 or u16) -> [..., D]. Ids outside [0, V) throw.
Tensor embedding(const Tensor& weight, const Tensor& ids);

}  // namespace moetrain
