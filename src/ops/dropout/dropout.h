// Dropout: y = x · m / (1 - p) with m ~ Bernoulli(1 - p) per element, drawn from
// a Philox generator. The mask is not stored: backward regenerates it from the
// generator's seed and the counter offset of the draw.
#pragma once

#include "core/rng.h"
#include "core/tensor.h"

namespace moetrain {

// Identity when p == 0 (models pass p = 0 when evaluating). Uses
// default_generator() unless a generator is given.
Tensor dropout(const Tensor& x, double p, Generator* gen = nullptr);

}  // namespace moetrain
