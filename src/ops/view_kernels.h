#pragma once

#include <vector>

#include "core/tensor.h"

namespace moetrain::cpu {

void permute_copy(Tensor& out, const Tensor& x, const std::vector<int64_t>& dims);
// Copies x viewed as [outer, x_mid, inner] into out [outer, out_mid, inner] at
// middle offset `at` (concat, slice backward) or the reverse (slice).
void copy_into_mid(Tensor& out, const Tensor& x, int64_t outer, int64_t inner, int64_t at);
void copy_from_mid(Tensor& out, const Tensor& x, int64_t outer, int64_t inner, int64_t at);
// out[o, i, :] = x[o, index[i], :]   and   grad_x[o, index[i], :] += grad_out[o, i, :]
void index_select_forward(Tensor& out, const Tensor& x, const Tensor& index, int64_t outer, int64_t inner);
void index_select_backward(Tensor& grad_x, const Tensor& grad_out, const Tensor& index, int64_t outer,
                           int64_t inner);

}  // namespace moetrain::cpu
