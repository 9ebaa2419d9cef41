// Philox-4x32-10 against the Random123 known-answer vectors, the moments of the
// samplers, independence from the thread count and the Generator's offsets.
#include <catch2/catch.hpp>

#include <array>
#include <cmath>
#include <cstdint>
#include <vector>

#include "backend/cpu/parallel.h"
#include "moetrain.h"
#include "testing.h"

using namespace moetrain;
using moetrain::testing::bitwise_equal;

namespace {

struct Moments {
  double mean = 0, var = 0, min = INFINITY, max = -INFINITY;
};

Moments moments(const std::vector<double>& v) {
  Moments m;
  for (double x : v) {
    m.mean += x;
    m.min = std::min(m.min, x);
    m.max = std::max(m.max, x);
  }
  m.mean /= static_cast<double>(v.size());
  for (double x : v) m.var += (x - m.mean) * (x - m.mean);
  m.var /= static_cast<double>(v.size() - 1);
  return m;
}

double std_normal_pdf(double x) { return std::exp(-0.5 * x * x) / std::sqrt(2 * M_PI); }
double std_normal_cdf(double x) { return 0.5 * std::erfc(-x / std::sqrt(2.0)); }

// Restores the thread count a test changed.
struct ThreadCountGuard {
  int saved = cpu::num_threads();
  ~ThreadCountGuard() { cpu::set_num_threads(saved); }
};

constexpr int64_t kSamples = 100000;

}  // namespace

TEST_CASE("rng: philox4x32-10 matches the Random123 known answers", "[core][rng]") {
  using A4 = std::array<uint32_t, 4>;
  using A2 = std::array<uint32_t, 2>;
  CHECK(philox4x32(A4{0, 0, 0, 0}, A2{0, 0}) == A4{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u});
  CHECK(philox4x32(A4{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}, A2{0xffffffffu, 0xffffffffu}) ==
        A4{0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu});
  CHECK(philox4x32(A4{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}, A2{0xa4093822u, 0x299f31d0u}) ==
        A4{0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u});
}

TEST_CASE("rng: a generator's bits are a pure function of seed and counter", "[core][rng]") {
  Generator a(123), b(123), c(124);
  CHECK(a.seed() == 123);
  CHECK(a.offset() == 0);
  CHECK(a.bits(5) == b.bits(5));
  CHECK(a.bits(5) != a.bits(6));
  CHECK(a.bits(5) != c.bits(5));
  // High counter and seed bits matter too.
  CHECK(a.bits(uint64_t{1} << 32) != a.bits(0));
  CHECK(Generator(uint64_t{1} << 32).bits(0) != Generator(0).bits(0));
  CHECK(a.uniform(9) == b.uniform(9));
  CHECK(a.normal(9) == b.normal(9));
  a.reserve(10);  // drawing does not change what a counter maps to
  CHECK(a.bits(5) == b.bits(5));
}

TEST_CASE("rng: uniform draws are 53-bit fractions in [0, 1)", "[core][rng]") {
  Generator gen(3);
  for (uint64_t c = 0; c < 10000; ++c) {
    double u = gen.uniform(c);
    REQUIRE(u >= 0.0);
    REQUIRE(u < 1.0);
    double scaled = u * 9007199254740992.0;  // 2^53
    REQUIRE(scaled == std::floor(scaled));
  }
}

TEST_CASE("rng: randn has mean 0 and variance 1; mean and std shift and scale", "[core][rng]") {
  Tensor x = randn({kSamples}, DType::f64, 2024);
  Moments m = moments(x.to_vector());
  // Standard errors: mean 1/sqrt(n) = 0.0032, variance sqrt(2/n) = 0.0045; allow ~6 of them.
  CHECK(std::abs(m.mean) < 0.02);
  CHECK(std::abs(m.var - 1.0) < 0.03);
  // Tail mass: P(x < 1) = 0.8413 (std error 0.0012).
  std::vector<double> v = x.to_vector();
  int64_t below = 0;
  for (double a : v) below += a < 1.0;
  CHECK(std::abs(static_cast<double>(below) / kSamples - std_normal_cdf(1.0)) < 0.007);

  Generator gen(5);
  Moments s = moments(randn({kSamples}, DType::f64, gen, 3.0, 2.0).to_vector());
  CHECK(std::abs(s.mean - 3.0) < 0.04);
  CHECK(std::abs(s.var - 4.0) < 0.12);
}

TEST_CASE("rng: rand is uniform on [0, 1) and on [low, high)", "[core][rng]") {
  Tensor x = rand({kSamples}, DType::f64, 99);
  std::vector<double> v = x.to_vector();
  Moments m = moments(v);
  CHECK(m.min >= 0.0);
  CHECK(m.max < 1.0);
  CHECK(std::abs(m.mean - 0.5) < 0.006);          // std error 0.0009
  CHECK(std::abs(m.var - 1.0 / 12.0) < 0.003);    // std error 0.0003
  std::vector<int64_t> bins(10, 0);
  for (double a : v) bins[static_cast<size_t>(a * 10)] += 1;
  for (int64_t b : bins) CHECK(std::abs(static_cast<double>(b) / kSamples - 0.1) < 0.006);  // std error 0.00095

  Generator gen(6);
  Moments s = moments(rand({kSamples}, DType::f64, gen, -2.0, 6.0).to_vector());
  CHECK(s.min >= -2.0);
  CHECK(s.max < 6.0);
  CHECK(std::abs(s.mean - 2.0) < 0.05);
  CHECK(std::abs(s.var - 64.0 / 12.0) < 0.2);
}

TEST_CASE("rng: trunc_normal stays in bounds with the truncated moments", "[core][rng]") {
  struct Case {
    double mean, std, a, b;
  };
  for (Case c : {Case{0.0, 1.0, -2.0, 2.0}, Case{1.0, 0.02, -2.0, 2.0}, Case{-0.5, 3.0, -1.0, 3.0}}) {
    DYNAMIC_SECTION("mean " << c.mean << " std " << c.std << " [" << c.a << ", " << c.b << "]") {
      Generator gen(11);
      Tensor x = trunc_normal({kSamples}, DType::f64, gen, c.mean, c.std, c.a, c.b);
      CHECK(gen.offset() == static_cast<uint64_t>(kSamples));
      Moments m = moments(x.to_vector());
      CHECK(m.min >= c.mean + c.a * c.std);
      CHECK(m.max <= c.mean + c.b * c.std);
      // Moments of the standard normal truncated to [a, b].
      double z = std_normal_cdf(c.b) - std_normal_cdf(c.a);
      double mu = (std_normal_pdf(c.a) - std_normal_pdf(c.b)) / z;
      double var = 1 + (c.a * std_normal_pdf(c.a) - c.b * std_normal_pdf(c.b)) / z - mu * mu;
      CHECK(std::abs((m.mean - c.mean) / c.std - mu) < 0.02);
      CHECK(std::abs(m.var / (c.std * c.std) - var) < 0.025);
      // Both tails near the bounds are reached (it is not clamped to a smaller range).
      CHECK(m.min < c.mean + (c.a + 0.05) * c.std);
      CHECK(m.max > c.mean + (c.b - 0.05) * c.std);
    }
  }
}

TEST_CASE("rng: trunc_normal is the exact inverse CDF of its uniform draw, tails included", "[core][rng]") {
  // Element i maps the uniform of counter i, u in [Phi(a), Phi(b)], to x with
  // Phi(x) = u: check that equation on every sample (std::erfc here, not the sampler).
  const double a = -3.0, b = 2.5;
  Generator gen(5), replay(5);
  const int64_t n = 20000;
  std::vector<double> x = trunc_normal({n}, DType::f64, gen, 0.0, 1.0, a, b).to_vector();
  const double lo = std_normal_cdf(a), hi = std_normal_cdf(b);
  double worst = 0;
  for (int64_t i = 0; i < n; ++i) {
    double u = lo + (hi - lo) * replay.uniform(static_cast<uint64_t>(i));
    worst = std::max(worst, std::abs(std_normal_cdf(x[static_cast<size_t>(i)]) - u));
  }
  CHECK(worst < 1e-15);
}

TEST_CASE("rng: randint covers [0, high) evenly", "[core][rng]") {
  Generator gen(8);
  Tensor t = randint({60000}, 6, DType::i64, gen);
  CHECK(t.dtype() == DType::i64);
  std::vector<int64_t> counts(6, 0);
  const int64_t* p = t.data<int64_t>();
  for (int64_t i = 0; i < t.numel(); ++i) {
    REQUIRE(p[i] >= 0);
    REQUIRE(p[i] < 6);
    counts[static_cast<size_t>(p[i])] += 1;
  }
  for (int64_t c : counts) CHECK(std::abs(c - 10000) < 600);  // std error 91
  Tensor u = randint({100}, 50000, DType::u16, gen);
  for (double v : u.to_vector()) CHECK(v < 50000);
}

TEST_CASE("rng: bad arguments throw naming the sampler", "[core][rng][errors]") {
  Generator gen(1);
  CHECK_THROWS_WITH(randn({3}, DType::i32, gen), Catch::Contains("randn"));
  CHECK_THROWS_WITH(rand({3}, DType::i64, gen), Catch::Contains("rand"));
  CHECK_THROWS_WITH(trunc_normal({3}, DType::u16, gen, 0, 1), Catch::Contains("trunc_normal"));
  CHECK_THROWS_WITH(trunc_normal({3}, DType::f32, gen, 0, 1, 2.0, -2.0), Catch::Contains("trunc_normal"));
  CHECK_THROWS_WITH(randint({3}, 0, DType::i64, gen), Catch::Contains("randint"));
  CHECK_THROWS_WITH(randint({3}, 5, DType::f32, gen), Catch::Contains("randint"));
}

TEST_CASE("rng: the same numbers for 1 and 2 threads", "[core][rng]") {
  ThreadCountGuard restore;
  // Above the 4096-element grain, so two threads really split the work.
  Shape shape{7, 4099};
  auto draw_all = [&] {
    Generator gen(314);
    Tensors out;
    out.push_back(randn(shape, DType::f32, gen));
    out.push_back(rand(shape, DType::f64, gen, -1, 1));
    out.push_back(trunc_normal(shape, DType::f32, gen, 0.0, 0.02));
    out.push_back(randn(shape, DType::bf16, gen));
    out.push_back(randint(shape, 1000, DType::i32, gen));
    return out;
  };
  cpu::set_num_threads(1);
  Tensors one = draw_all();
  cpu::set_num_threads(2);
  Tensors two = draw_all();
  for (size_t i = 0; i < one.size(); ++i) {
    INFO("draw " << i);
    CHECK(bitwise_equal(one[i], two[i]));
  }
}

TEST_CASE("rng: two draws of n then m equal one draw of n + m", "[core][rng]") {
  const int64_t n = 4097, m = 1234;
  auto check_split = [&](auto&& draw) {
    Generator g1(21), g2(21);
    Tensor first = draw(g1, n);
    CHECK(g1.offset() == static_cast<uint64_t>(n));
    Tensor second = draw(g1, m);
    CHECK(g1.offset() == static_cast<uint64_t>(n + m));
    Tensor whole = draw(g2, n + m);
    CHECK(g2.offset() == static_cast<uint64_t>(n + m));
    CHECK(bitwise_equal(first, slice(whole, 0, 0, n)));
    CHECK(bitwise_equal(second, slice(whole, 0, n, n + m)));
  };
  SECTION("randn") {
    check_split([](Generator& g, int64_t k) { return randn({k}, DType::f32, g); });
  }
  SECTION("rand") {
    check_split([](Generator& g, int64_t k) { return rand({k}, DType::f64, g); });
  }
  SECTION("trunc_normal") {
    check_split([](Generator& g, int64_t k) { return trunc_normal({k}, DType::f64, g, 0.0, 1.0); });
  }
  SECTION("randint") {
    check_split([](Generator& g, int64_t k) { return randint({k}, 77, DType::i64, g); });
  }
}

TEST_CASE("rng: set_offset replays a draw; reserve hands out counters", "[core][rng]") {
  Generator gen(4);
  CHECK(gen.reserve(10) == 0);
  CHECK(gen.reserve(5) == 10);
  CHECK(gen.offset() == 15);
  Tensor a = randn({2, 33}, DType::f64, gen);
  CHECK(gen.offset() == 15 + 66);
  gen.set_offset(15);
  Tensor b = randn({2, 33}, DType::f64, gen);
  CHECK(bitwise_equal(a, b));
  // Element i of a draw at offset o is normal(o + i).
  std::vector<double> v = a.to_vector();
  for (uint64_t i = 0; i < v.size(); ++i) CHECK(v[i] == gen.normal(15 + i));
  CHECK(randn({4}, DType::f64, gen).to_vector() != randn({4}, DType::f64, gen).to_vector());
}

TEST_CASE("rng: seed forms equal a fresh generator; dtypes round the same draw", "[core][rng]") {
  Generator gen(17);
  CHECK(bitwise_equal(randn({3, 31}, DType::f64, 17), randn({3, 31}, DType::f64, gen)));
  Generator gen2(17);
  CHECK(bitwise_equal(rand({3, 31}, DType::f32, 17), rand({3, 31}, DType::f32, gen2)));
  CHECK_FALSE(bitwise_equal(randn({3, 31}, DType::f64, 17), randn({3, 31}, DType::f64, 18)));
  // Computed in double, rounded to the dtype.
  std::vector<double> d = randn({100}, DType::f64, 5).to_vector();
  Tensor f = randn({100}, DType::f32, 5), h = randn({100}, DType::bf16, 5);
  const float* pf = f.data<float>();
  const bf16* ph = h.data<bf16>();
  for (size_t i = 0; i < d.size(); ++i) {
    REQUIRE(pf[i] == static_cast<float>(d[i]));
    REQUIRE(ph[i].bits == bf16::from_float(static_cast<float>(d[i])).bits);
  }
}

TEST_CASE("rng: the default generator is one process-wide instance", "[core][rng]") {
  Generator& g = default_generator();
  CHECK(&g == &default_generator());
  uint64_t before = g.offset();
  rand({10}, DType::f32, default_generator());
  CHECK(default_generator().offset() == before + 10);
}
