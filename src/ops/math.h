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

template <>
inline float tanh_of<float>(float u) {
  double a = std::abs(static_cast<double>(u));
  if (a < 1e-4) return u - u * u * u / 3.0f;  // series; exact to float precision here
  if (a > 10.0) return std::copysign(1.0f, u);
  double t = 1.0 - 2.0 / (std::exp(2.0 * a) + 1.0);
  return std::copysign(static_cast<float>(t), u);
}

template <class T>
inline T sigmoid_of(T x) {
  return x >= 0 ? T(1) / (T(1) + std::exp(-x)) : std::exp(x) / (T(1) + std::exp(x));
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
