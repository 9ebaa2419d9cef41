// Shape: up to kMaxDims extents, stored inline (no allocation). Tensors are
// contiguous row-major, so a shape fully describes the layout. Negative dim
// indices count from the end, as in PyTorch.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <vector>

#include <fmt/format.h>

namespace moetrain {

class Shape {
 public:
  static constexpr int kMaxDims = 8;

  Shape() = default;
  Shape(std::initializer_list<int64_t> dims);
  explicit Shape(std::span<const int64_t> dims);
  explicit Shape(const std::vector<int64_t>& dims) : Shape(std::span<const int64_t>(dims.data(), dims.size())) {}

  int ndim() const { return ndim_; }
  int64_t operator[](int i) const { return dims_[i]; }
  int64_t& operator[](int i) { return dims_[i]; }
  // Extent of dim d (negative counts from the end); throws on a bad dim.
  int64_t size(int64_t d) const { return dims_[normalize_dim(d)]; }
  int64_t numel() const;
  // Product of extents in [begin, end).
  int64_t numel(int begin, int end) const;

  // Maps a possibly negative dim to [0, ndim); throws moetrain::Error when out of range.
  int normalize_dim(int64_t d) const;

  Shape drop_last() const;
  Shape with(int d, int64_t extent) const;  // copy with dim d replaced
  Shape appended(int64_t extent) const;
  std::span<const int64_t> dims() const { return {dims_.data(), static_cast<size_t>(ndim_)}; }
  std::vector<int64_t> vec() const { return {dims_.begin(), dims_.begin() + ndim_}; }

  bool operator==(const Shape& o) const;
  std::string str() const;

 private:
  std::array<int64_t, kMaxDims> dims_{};
  int ndim_ = 0;
};

}  // namespace moetrain

template <>
struct fmt::formatter<moetrain::Shape> : fmt::formatter<std::string> {
  auto format(const moetrain::Shape& s, format_context& ctx) const {
    return fmt::formatter<std::string>::format(s.str(), ctx);
  }
};
