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

}  // namespace moetrain
