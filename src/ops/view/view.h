// Shape ops. reshape and leading-range slices are views (shared storage);
// permute, transpose, general slices, concat and index_select copy.
#pragma once

#include <initializer_list>
#include <vector>

#include "core/tensor.h"

namespace moetrain {

// View with another shape; one extent of `dims` may be -1 (inferred).
Tensor reshape(const Tensor& x, const std::vector<int64_t>& dims);
Tensor reshape(const Tensor& x, std::initializer_list<int64_t> dims);
Tensor reshape(const Tensor& x, const Shape& shape);
Tensor flatten(const Tensor& x, int64_t start_dim = 0, int64_t end_dim = -1);
Tensor permute(const Tensor& x, const std::vector<int64_t>& dims);
Tensor transpose(const Tensor& x, int64_t dim0, int64_t dim1);
// Elements [start, end) of `dim` (negative start/end count from the end).
Tensor slice(const Tensor& x, int64_t dim, int64_t start, int64_t end);
Tensor concat(const Tensors& xs, int64_t dim);
Tensors split(const Tensor& x, const std::vector<int64_t>& sizes, int64_t dim);
// x with `dim` replaced by the entries `index` [n] (i32 or i64) selects.
Tensor index_select(const Tensor& x, int64_t dim, const Tensor& index);
// The same with host indices (an i64 tensor made of them).
Tensor index_select(const Tensor& x, int64_t dim, const std::vector<int64_t>& index);

}  // namespace moetrain
