#include "core/shape.h"

#include "core/error.h"

namespace moetrain {

Shape::Shape(std::initializer_list<int64_t> dims) : Shape(std::span<const int64_t>(dims.begin(), dims.size())) {}

Shape::Shape(std::span<const int64_t> dims) {
  MT_CHECK(dims.size() <= static_cast<size_t>(kMaxDims), "shape has {} dims; at most {} are supported",
           dims.size(), kMaxDims);
  int64_t product = 1;  // of the non-zero extents, so numel() over any range fits in int64
  for (size_t i = 0; i < dims.size(); ++i) {
    MT_CHECK(dims[i] >= 0, "shape [{}] has a negative extent at dim {}", fmt::join(dims, ", "), i);
    if (dims[i] != 0 && __builtin_mul_overflow(product, dims[i], &product))
      throw OutOfMemoryError(fmt::format("shape [{}] has more than 2^63 elements (a size in the config or the file "
                                         "is far too large)", fmt::join(dims, ", ")));
    dims_[i] = dims[i];
  }
  ndim_ = static_cast<int>(dims.size());
}

int64_t Shape::numel() const { return numel(0, ndim_); }

int64_t Shape::numel(int begin, int end) const {
  int64_t n = 1;
  for (int i = begin; i < end; ++i) n *= dims_[i];
  return n;
}

int Shape::normalize_dim(int64_t d) const {
  int64_t nd = d < 0 ? d + ndim_ : d;
  MT_CHECK(nd >= 0 && nd < ndim_, "dim {} is out of range for a tensor of shape {} (rank {})", d, str(), ndim_);
  return static_cast<int>(nd);
}

Shape Shape::drop_last() const {
  MT_CHECK(ndim_ > 0, "drop_last on a rank-0 shape");
  Shape s = *this;
  s.ndim_ -= 1;
  s.dims_[s.ndim_] = 0;
  return s;
}

Shape Shape::with(int d, int64_t extent) const {
  Shape s = *this;
  s.dims_[normalize_dim(d)] = extent;
  return s;
}

Shape Shape::appended(int64_t extent) const {
  MT_CHECK(ndim_ < kMaxDims, "shape {} cannot grow beyond {} dims", str(), kMaxDims);
  Shape s = *this;
  s.dims_[s.ndim_++] = extent;
  return s;
}

bool Shape::operator==(const Shape& o) const {
  if (ndim_ != o.ndim_) return false;
  for (int i = 0; i < ndim_; ++i)
    if (dims_[i] != o.dims_[i]) return false;
  return true;
}

std::string Shape::str() const { return fmt::format("[{}]", fmt::join(dims(), ", ")); }

}  // namespace moetrain
