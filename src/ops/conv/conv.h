// Depthwise causal 1-D convolution over time (KDA short convolution, docs/model.md#short-convolution):
//   y[b, t, c] = Σ_{i<W} w[c, i] · x[b, t-(W-1)+i, c]     (x = 0 before t = 0)
// w[c, W-1] multiplies the current token. No bias, no activation.
#pragma once

#include "core/tensor.h"

namespace moetrain {

// x [B, T, C], weight [C, W] -> [B, T, C].
Tensor causal_conv1d(const Tensor& x, const Tensor& weight);

}  // namespace moetrain
