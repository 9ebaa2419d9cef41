#pragma once

#include "core/tensor.h"

namespace moetrain::cpu {

// out = op(a) op(b) for the layouts documented in linalg.h; out is [..., M, N].
void matmul_forward(Tensor& out, const Tensor& a, const Tensor& b, bool trans_a, bool trans_b);

}  // namespace moetrain::cpu
