// Reductions over one dim (keepdim keeps it as size 1) or over everything.
// Float sums accumulate in double, in a fixed order (thread-count independent).
#pragma once

#include "core/tensor.h"

namespace moetrain {

Tensor sum(const Tensor& x, int64_t dim, bool keepdim = false);
Tensor sum(const Tensor& x);  // all elements -> shape []
Tensor mean(const Tensor& x, int64_t dim, bool keepdim = false);
Tensor mean(const Tensor& x);
// Maximum over dim; the gradient goes to the first maximal element.
Tensor max(const Tensor& x, int64_t dim, bool keepdim = false);
// Index (i64) of the first maximal element over dim; no gradient.
Tensor argmax(const Tensor& x, int64_t dim, bool keepdim = false);
// Elements that are NaN or +-infinity (0 for integer tensors); no gradient. CUDA
// tensors are counted on a host copy (for exports and loads, not the step).
int64_t count_non_finite(const Tensor& x);

}  // namespace moetrain
