// Inputs and the widening route for the tests of the CPU kernels with a bf16 path of
// their own (tests/ops/bf16_cpu_rows_*_test.cpp): each kernel against the f32 kernel on
// widened copies, rounded once (cpu::run_kernel's route, ops/common/bf16_widen.h).
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "backend/cpu/parallel.h"
#include "moetrain.h"
#include "ops/common/bf16_widen.h"
#include "testing.h"

namespace moetrain::testing {

// randn values times scale, rounded to bf16.
inline Tensor bf16_rnd(const Shape& s, uint64_t seed, double scale = 1.0) {
  return mul_scalar(randn(s, DType::f32, seed), scale).to(DType::bf16).detach();
}
// bf16 values of two magnitudes (a third ±2^20, the rest randn), their signs random:
// an f32 sum of them cancels the large ones exactly and loses the small ones' bits
// by an amount that depends on the order of the additions, so a sum taken in another
// order than the f32 kernel's shows after the bf16 rounding too (sums of values of one
// magnitude are often exact in f32: bf16 has 8 significant bits, f32 24).
inline Tensor bf16_spread(const Shape& s, uint64_t seed) {
  const std::vector<double> v = randn(s, DType::f64, seed).to_vector();
  std::vector<double> out(v.size());
  uint64_t h = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t i = 0; i < v.size(); ++i) {
    h = h * 6364136223846793005ull + 1442695040888963407ull;
    out[i] = (h >> 33) % 3 == 0 ? std::copysign(1048576.0, v[i]) : v[i];
  }
  return from_vector(out, s, DType::bf16);
}
// The widening route's halves: a bf16 tensor's f32 copy (undefined stays undefined)
// and an f32 result rounded once to bf16.
inline Tensor bf16_widened(const Tensor& t) { return t.defined() ? cpu::widen_bf16(t) : Tensor(); }
inline Tensor bf16_rounded(const Tensor& f32) {
  Tensor out = empty(f32.shape(), DType::bf16);
  cpu::round_into_bf16(out, f32);
  return out;
}

// Restores the thread count when the scope ends.
struct ThreadCountGuard {
  int saved = cpu::num_threads();
  ~ThreadCountGuard() { cpu::set_num_threads(saved); }
};

}  // namespace moetrain::testing
