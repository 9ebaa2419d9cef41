// How the engine adds gradients: declared here, defined with the elementwise
// ops (ops/elementwise/grad_sum.cpp). The ops sit above autograd (each op
// records its node), so the engine cannot include them; it calls these two.
#pragma once

#include "core/tensor.h"

namespace moetrain::autograd {

// a + b out of place; bf16 gradients are summed in f32 and rounded once.
Tensor grad_sum(const Tensor& a, const Tensor& b);
// dst += src in place (a leaf's own grad buffer; bf16 as grad_sum does).
void grad_add_(const Tensor& dst, const Tensor& src);

}  // namespace moetrain::autograd
