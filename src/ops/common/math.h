// Scalar math shared by CPU kernels, written so loops over arrays inline and
// vectorise. glibc's expf is an opaque call (~4 ns each here) and tanhf goes
// through expm1f (~20 ns on random data).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace moetrain::cpu {

// e^x for float, within 2 ulp of expf over the whole range, branch-free so
// compilers vectorise loops calling it: x = k ln2 + r (Cody-Waite, |r| <= ln2/2),
// e^r by a degree-6 polynomial (Cephes expf coefficients), times 2^k.
// Returns 0 below -87.33 (where expf is denormal or 0) and +inf above 88.72.
inline float exp_approx(float x) {
  const float hi = 88.7228f, lo = -87.3365f;
  float xc = x > hi ? hi : (x < lo ? lo : x);
  const float round_magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  float kf = (xc * 1.44269504088896341f + round_magic) - round_magic;
  float r = xc - kf * 0.693359375f;
  r = r - kf * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  float y = p * r * r + r + 1.0f;
  // 2^k as 2^(k/2) 2^(k - k/2): k spans [-126, 128], beyond one float exponent.
  int32_t k = static_cast<int32_t>(kf), k1 = k >> 1, k2 = k - k1;
  int32_t b1 = (k1 + 127) << 23, b2 = (k2 + 127) << 23;
  float s1, s2;
  std::memcpy(&s1, &b1, 4);
  std::memcpy(&s2, &b2, 4);
  y = y * s1 * s2;
  y = x < lo ? 0.0f : y;
  return x > hi ? INFINITY : y;
}

template <class T>
inline T exp_of(T x) {
  return std::exp(x);
}
template <>
inline float exp_of<float>(float x) {
  return exp_approx(x);
}

template <class T>
inline T tanh_of(T u) {
  return std::tanh(u);
}

// tanh for float, branch-free so loops vectorise (Cephes tanhf's scheme): below
// |u| = 0.625 the odd polynomial u + u^3 P(u^2), above 1 - 2 / (e^{2|u|} + 1) with
// exp_approx (no cancellation there: the result is > 0.55); within a few ulp of tanhf.
template <>
inline float tanh_of<float>(float u) {
  float a = std::abs(u);
  float s = u * u;
  float p = -5.70498872745e-3f;
  p = p * s + 2.06390887954e-2f;
  p = p * s - 5.37397155531e-2f;
  p = p * s + 1.33314422036e-1f;
  p = p * s - 3.33332819422e-1f;
  float small = p * s * u + u;
  float big = 1.0f - 2.0f / (exp_approx(2.0f * a) + 1.0f);  // exp_approx saturates to inf: big = 1
  big = std::copysign(big, u);
  return a < 0.625f ? small : big;
}

template <class T>
inline T sigmoid_of(T x) {
  return x >= 0 ? T(1) / (T(1) + std::exp(-x)) : std::exp(x) / (T(1) + std::exp(x));
}
// Branch-free for float: 1 / (1 + e^{-x}) with exp_approx, which saturates to +inf
// below x = -88.7 (giving 0) and to 0 above 87.3 (giving 1).
template <>
inline float sigmoid_of<float>(float x) {
  return 1.0f / (1.0f + exp_approx(-x));
}

// Row reductions in 8 independent lanes combined in a fixed order, so the loops
// vectorise (a single running sum cannot be reordered) and the result does not
// depend on anything but n.
inline constexpr int kLanes = 8;

template <class T>
inline T max_of(const T* x, int64_t n) {
  T acc[kLanes];
  for (int k = 0; k < kLanes; ++k) acc[k] = -INFINITY;
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int k = 0; k < kLanes; ++k) acc[k] = x[j + k] > acc[k] ? x[j + k] : acc[k];
  T m = -INFINITY;
  for (; j < n; ++j) m = x[j] > m ? x[j] : m;
  for (int k = 0; k < kLanes; ++k) m = acc[k] > m ? acc[k] : m;
  return m;
}

// Σ_j x[j] in double.
template <class T>
inline double sum_of(const T* x, int64_t n) {
  double acc[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int k = 0; k < kLanes; ++k) acc[k] += static_cast<double>(x[j + k]);
  double s = 0;
  for (; j < n; ++j) s += static_cast<double>(x[j]);
  for (int k = 0; k < kLanes; ++k) s += acc[k];
  return s;
}

// Σ_j e^(x[j] - shift), exponentials in T, sums in double.
template <class T>
inline double sum_exp(const T* x, int64_t n, T shift) {
  double acc[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int k = 0; k < kLanes; ++k) acc[k] += static_cast<double>(exp_of(x[j + k] - shift));
  double s = 0;
  for (; j < n; ++j) s += static_cast<double>(exp_of(x[j] - shift));
  for (int k = 0; k < kLanes; ++k) s += acc[k];
  return s;
}

}  // namespace moetrain::cpu
