#include "core/rng.h"

#include <cmath>

#include "backend/cpu/parallel.h"
#include "core/dispatch.h"

namespace moetrain {

std::array<uint32_t, 4> philox4x32(std::array<uint32_t, 4> c, std::array<uint32_t, 2> k) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    uint64_t p0 = static_cast<uint64_t>(kMul0) * c[0];
    uint64_t p1 = static_cast<uint64_t>(kMul1) * c[2];
    uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    c = {hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0};
    k[0] += kWeyl0;
    k[1] += kWeyl1;
  }
  return c;
}

std::array<uint32_t, 4> Generator::bits(uint64_t counter) const {
  return philox4x32({static_cast<uint32_t>(counter), static_cast<uint32_t>(counter >> 32), 0u, 0u},
                    {static_cast<uint32_t>(seed_), static_cast<uint32_t>(seed_ >> 32)});
}

namespace {
constexpr double kTwoPow53 = 9007199254740992.0;
double to_unit(uint32_t hi, uint32_t lo) {  // 53 bits -> [0, 1)
  uint64_t v = (static_cast<uint64_t>(hi) << 21) ^ (lo >> 11);
  return static_cast<double>(v & ((uint64_t{1} << 53) - 1)) / kTwoPow53;
}
}  // namespace

double Generator::uniform(uint64_t counter) const {
  auto r = bits(counter);
  return to_unit(r[0], r[1]);
}

double Generator::normal(uint64_t counter) const {
  auto r = bits(counter);
  double u1 = 1.0 - to_unit(r[0], r[1]);  // (0, 1]: log is finite
  double u2 = to_unit(r[2], r[3]);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
}

Generator& default_generator() {
  static Generator gen(0);
  return gen;
}

namespace {
template <class F>
Tensor generate(const Shape& shape, DType dtype, Generator& gen, F&& value_at) {
  Tensor t = empty(shape, dtype);
  uint64_t first = gen.reserve(static_cast<uint64_t>(t.numel()));
  dispatch_all(dtype, [&](auto tag) {
    using T = decltype(tag);
    T* p = t.data<T>();
    cpu::parallel_for(t.numel(), 4096, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) p[i] = from_double<T>(value_at(first + static_cast<uint64_t>(i)));
    });
  });
  return t;
}
}  // namespace

Tensor randn(const Shape& shape, DType dtype, uint64_t seed) {
  Generator gen(seed);
  return randn(shape, dtype, gen);
}

Tensor rand(const Shape& shape, DType dtype, uint64_t seed) {
  Generator gen(seed);
  return rand(shape, dtype, gen);
}

Tensor randn(const Shape& shape, DType dtype, Generator& gen, double mean, double std) {
  MT_CHECK(is_floating(dtype), "randn: dtype {} is not floating", dtype);
  return generate(shape, dtype, gen, [&](uint64_t c) { return mean + std * gen.normal(c); });
}

Tensor rand(const Shape& shape, DType dtype, Generator& gen, double low, double high) {
  MT_CHECK(is_floating(dtype), "rand: dtype {} is not floating", dtype);
  return generate(shape, dtype, gen, [&](uint64_t c) { return low + (high - low) * gen.uniform(c); });
}

Tensor trunc_normal(const Shape& shape, DType dtype, Generator& gen, double mean, double std, double a, double b) {
  MT_CHECK(is_floating(dtype), "trunc_normal: dtype {} is not floating", dtype);
  MT_CHECK(a < b, "trunc_normal: bounds a = {} must be below b = {}", a, b);
  // Inverse CDF: u uniform in [Phi(a), Phi(b)], x = Phi^-1(u) via erfinv by Newton on erf.
  auto phi = [](double x) { return 0.5 * std::erfc(-x / std::sqrt(2.0)); };
  double lo = phi(a), hi = phi(b);
  return generate(shape, dtype, gen, [&](uint64_t c) {
    double u = lo + (hi - lo) * gen.uniform(c);
    double x = std::clamp(0.0, a, b);  // Newton on Phi(x) = u, bracketed in [a, b]
    double left = a, right = b;
    for (int it = 0; it < 60; ++it) {
      double f = phi(x) - u;
      if (f > 0) right = x;
      else left = x;
      double pdf = std::exp(-0.5 * x * x) / std::sqrt(2.0 * M_PI);
      double nx = pdf > 1e-300 ? x - f / pdf : 0.5 * (left + right);
      if (!(nx > left && nx < right)) nx = 0.5 * (left + right);
      if (std::abs(nx - x) < 1e-15) {
        x = nx;
        break;
      }
      x = nx;
    }
    return mean + std * x;
  });
}

Tensor randint(const Shape& shape, int64_t high, DType dtype, Generator& gen) {
  MT_CHECK(high > 0, "randint: high = {} must be positive", high);
  MT_CHECK(is_integral(dtype), "randint: dtype {} is not an integer type", dtype);
  return generate(shape, dtype, gen, [&](uint64_t c) {
    auto r = gen.bits(c);
    uint64_t v = (static_cast<uint64_t>(r[0]) << 32) | r[1];
    return static_cast<double>(v % static_cast<uint64_t>(high));
  });
}

}  // namespace moetrain
