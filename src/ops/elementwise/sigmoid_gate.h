// y = x ⊙ σ(z): an output gate (MLA's, docs/model.md) as one op instead of sigmoid
// then mul, so a step launches one kernel where it launched two, and backward one
// where it launched three (mul's two products and sigmoid's derivative).
// Same shapes, no broadcasting. Backward (sigmoid_gate_kernels in
// ops/elementwise/elementwise_kernels.h): grad_x = grad_y σ(z),
// grad_z = grad_y x σ(z) (1 - σ(z)). Arithmetic in the compute type (f32 for bf16),
// rounded once per output, where sigmoid then mul rounds σ(z) to bf16 first.
#pragma once

#include "core/tensor.h"

namespace moetrain {

Tensor sigmoid_gate(const Tensor& x, const Tensor& z);

}  // namespace moetrain
