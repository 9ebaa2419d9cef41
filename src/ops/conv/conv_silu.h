// silu(causal_conv1d(x, w)) as one op (KDA's short convolution and its activation,
// docs/model.md#short-convolution): the SiLU is applied in the conv kernel's
// epilogue, and backward recomputes the conv's output where it needs σ (W taps a
// point) instead of reading a saved one. A step launches one kernel forward instead
// of two and three backward instead of four (docs/cuda.md, "The launch path and the
// launch counter"). Values and gradients equal silu(causal_conv1d(x, w)) to rounding
// (the same bits on CUDA in f32 and f64: conv_silu_simt.h).
#pragma once

#include "core/tensor.h"

namespace moetrain {

// x [B, T, C], weight [C, W] -> [B, T, C] in the weight's dtype. x may be bf16 under an
// f32 weight (mixed precision: KDA's conv weights stay f32): the cast of x to f32 is
// fused too, silu(causal_conv1d(x.to(f32), w)) in one kernel forward and none more
// backward (grad_x is rounded to bf16 in the kernel, as the cast's backward rounds it).
Tensor causal_conv1d_silu(const Tensor& x, const Tensor& weight);

}  // namespace moetrain
