// Counter-based random numbers (Philox-4x32-10, Salmon et al., SC'11, the
// generator of cuRAND and PyTorch's CUDA RNG). Element i of a draw at generator
// offset o is a pure function of (seed, o + i), so the numbers do not depend on
// the device, the thread count or how the work is split.
//
// Uniform: 53 random bits -> a double in [0, 1). Normal: Box-Muller on two
// such uniforms (cos branch), computed in double and rounded to the dtype.
#pragma once

#include <array>
#include <cstdint>

#include "core/tensor.h"

namespace moetrain {

std::array<uint32_t, 4> philox4x32(std::array<uint32_t, 4> counter, std::array<uint32_t, 2> key);

class Generator {
 public:
  explicit Generator(uint64_t seed = 0) : seed_(seed) {}
  uint64_t seed() const { return seed_; }
  uint64_t offset() const { return offset_; }
  void set_offset(uint64_t offset) { offset_ = offset; }
  // Reserves n counters and returns the first.
  uint64_t reserve(uint64_t n) {
    uint64_t first = offset_;
    offset_ += n;
    return first;
  }

  // The raw 128 bits for counter c.
  std::array<uint32_t, 4> bits(uint64_t counter) const;
  double uniform(uint64_t counter) const;  // [0, 1)
  double normal(uint64_t counter) const;   // N(0, 1)

 private:
  uint64_t seed_;
  uint64_t offset_ = 0;
};

// The process-wide generator used by random ops (dropout, sampling) unless one
// is given; checkpoint() rewinds it to replay random ops during recomputation.
Generator& default_generator();

// Fresh tensors. The seed forms use a new Generator(seed).
Tensor randn(const Shape& shape, DType dtype, uint64_t seed);
Tensor rand(const Shape& shape, DType dtype, uint64_t seed);  // U[0, 1)
Tensor randn(const Shape& shape, DType dtype, Generator& gen, double mean = 0.0, double std = 1.0);
Tensor rand(const Shape& shape, DType dtype, Generator& gen, double low = 0.0, double high = 1.0);
// Normal truncated to [mean + a*std, mean + b*std] by inverse-CDF sampling.
Tensor trunc_normal(const Shape& shape, DType dtype, Generator& gen, double mean, double std, double a = -2.0,
                    double b = 2.0);
// Random integers in [0, high).
Tensor randint(const Shape& shape, int64_t high, DType dtype, Generator& gen);

}  // namespace moetrain
