// Copies and conversions: Tensor::clone, Tensor::to(DType), Tensor::to(Device),
// Tensor::contiguous and Tensor::reshape are defined here (all differentiable).
// Floating conversions round to nearest (even for bf16); conversions to integer
// dtypes truncate toward zero and carry no gradient.
#pragma once

#include "core/tensor.h"

namespace moetrain::cpu {

// out[i] = convert(x[i]) for any pair of dtypes (same shape).
void convert(Tensor& out, const Tensor& x);

}  // namespace moetrain::cpu
