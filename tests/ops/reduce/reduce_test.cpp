// Reductions: sum, mean and max over each dim (with and without keepdim) and
// over everything, argmax, gradients, and bitwise independence from the thread
// count.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "backend/cpu/parallel.h"
#include "moetrain.h"
#include "testing.h"
#include "ops/cuda_vs_cpu.h"

using namespace moetrain;
using moetrain::testing::bitwise_equal;
using moetrain::testing::check_gradients;

namespace {

enum class Red { sum, mean, max, argmax };

// Reference reduction over dim d of x viewed as [outer, n, inner], in double.
std::vector<double> reduce_ref(const std::vector<double>& x, const Shape& s, int d, Red r) {
  int64_t outer = s.numel(0, d), n = s[d], inner = s.numel(d + 1, s.ndim());
  std::vector<double> out(static_cast<size_t>(outer * inner));
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t j = 0; j < inner; ++j) {
      double acc = 0, best = -INFINITY;
      int64_t arg = -1;
      for (int64_t i = 0; i < n; ++i) {
        double v = x[static_cast<size_t>((o * n + i) * inner + j)];
        acc += v;
        if (arg < 0 || v > best) {
          best = v;
          arg = i;
        }
      }
      double result = r == Red::sum ? acc : r == Red::mean ? acc / static_cast<double>(n) : r == Red::max ? best : static_cast<double>(arg);
      out[static_cast<size_t>(o * inner + j)] = result;
    }
  return out;
}

Shape reduced_shape(const Shape& s, int d, bool keepdim) {
  if (keepdim) return s.with(d, 1);
  std::vector<int64_t> dims;
  for (int i = 0; i < s.ndim(); ++i)
    if (i != d) dims.push_back(s[i]);
  return Shape(dims);
}

// A random permutation of 0.1 * [0, n) plus small noise: distinct values at
// least 0.05 apart, so finite differences never cross a tie.
Tensor distinct(const Shape& s, uint64_t seed) {
  int64_t n = s.numel();
  std::vector<double> v(static_cast<size_t>(n));
  Generator gen(seed);
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = static_cast<double>(i);
  for (int64_t i = n - 1; i > 0; --i) {  // Fisher-Yates with the Philox stream
    int64_t j = static_cast<int64_t>(gen.bits(static_cast<uint64_t>(i))[0] % static_cast<uint64_t>(i + 1));
    std::swap(v[static_cast<size_t>(i)], v[static_cast<size_t>(j)]);
  }
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = 0.1 * v[static_cast<size_t>(i)] - 1.0 + 0.01 * gen.uniform(static_cast<uint64_t>(n + i));
  return from_vector(v, s, DType::f64);
}

struct ThreadCountGuard {
  int saved = cpu::num_threads();
  ~ThreadCountGuard() { cpu::set_num_threads(saved); }
};

}  // namespace

TEST_CASE("reduce: sum, mean, max and argmax over each dim match loops", "[ops][reduce]") {
  for (Shape s : {Shape{3, 31, 5}, Shape{2, 3, 130}, Shape{7, 1, 33}}) {
    for (DType dt : {DType::f64, DType::f32}) {
      Tensor x = randn(s, dt, 1);
      std::vector<double> v = x.to_vector();
      for (int d = 0; d < s.ndim(); ++d)
        for (bool keepdim : {false, true}) {
          DYNAMIC_SECTION(s.str() << " " << dtype_name(dt) << " dim " << d << " keepdim " << keepdim) {
            Shape want = reduced_shape(s, d, keepdim);
            double tol = dt == DType::f64 ? 1e-13 : 1e-6;
            Tensor ys = sum(x, d, keepdim), ym = mean(x, d, keepdim), yx = max(x, d, keepdim),
                   ya = argmax(x, d, keepdim);
            REQUIRE(ys.shape() == want);
            REQUIRE(ym.shape() == want);
            REQUIRE(yx.shape() == want);
            REQUIRE(ya.shape() == want);
            CHECK(ys.dtype() == dt);
            CHECK(ym.dtype() == dt);
            CHECK(yx.dtype() == dt);
            CHECK(ya.dtype() == DType::i64);
            std::vector<double> rs = reduce_ref(v, s, d, Red::sum), rm = reduce_ref(v, s, d, Red::mean),
                                rx = reduce_ref(v, s, d, Red::max), ra = reduce_ref(v, s, d, Red::argmax);
            std::vector<double> gs = ys.to_vector(), gm = ym.to_vector(), gx = yx.to_vector(), ga = ya.to_vector();
            for (size_t i = 0; i < rs.size(); ++i) {
              REQUIRE(gs[i] == Approx(rs[i]).epsilon(tol).margin(tol));
              REQUIRE(gm[i] == Approx(rm[i]).epsilon(tol).margin(tol));
              REQUIRE(gx[i] == rx[i]);
              REQUIRE(ga[i] == ra[i]);
            }
          }
        }
    }
  }
}

TEST_CASE("reduce: negative dims and rank 1", "[ops][reduce]") {
  Tensor x = randn({4, 6}, DType::f64, 2);
  CHECK(bitwise_equal(sum(x, -1), sum(x, 1)));
  CHECK(bitwise_equal(max(x, -2, true), max(x, 0, true)));
  Tensor v = from_vector({1, 5, -2, 5}, {4}, DType::f64);
  CHECK(sum(v, 0).shape() == Shape{});
  CHECK(sum(v, 0).item<double>() == 9.0);
  CHECK(sum(v, 0, true).shape() == Shape{1});
  CHECK(mean(v, 0).item<double>() == 2.25);
  CHECK(max(v, 0).item<double>() == 5.0);
  CHECK(argmax(v, 0).item<int64_t>() == 1);  // the first of two maxima
}

TEST_CASE("reduce: sum and mean of everything", "[ops][reduce]") {
  for (Shape s : {Shape{3, 31}, Shape{5}, Shape{}, Shape{3, 4097}}) {
    DYNAMIC_SECTION(s.str()) {
      Tensor x = randn(s, DType::f64, 3);
      std::vector<double> v = x.to_vector();
      double ref = 0;
      for (double a : v) ref += a;
      Tensor total = sum(x), avg = mean(x);
      CHECK(total.shape() == Shape{});
      CHECK(avg.shape() == Shape{});
      // Summation order is the kernel's choice: allow n ulps of the largest partial sums.
      double tol = 1e-15 * static_cast<double>(v.size()) * 10;
      CHECK(total.item<double>() == Approx(ref).margin(tol));
      CHECK(avg.item<double>() == Approx(ref / static_cast<double>(v.size())).margin(tol / static_cast<double>(v.size())));
    }
  }
  // f32 accumulates in double: a sum f32 accumulation would lose entirely.
  Tensor big = concat({full({1}, 16777216.0), ones({1000})}, 0);
  CHECK(sum(big).item<double>() == 16777216.0 + 1000.0);
  CHECK(sum(big, 0).item<double>() == 16777216.0 + 1000.0);
}

TEST_CASE("reduce: max and argmax take the first of equal maxima; NaN wins", "[ops][reduce]") {
  Tensor x = from_vector({1, 3, 3, 0,    //
                          2, 2, 2, 2,    //
                          -1, 4, -5, 4}, {3, 4}, DType::f64);
  CHECK(argmax(x, 1).to_vector() == std::vector<double>{1, 0, 1});
  CHECK(max(x, 1).to_vector() == std::vector<double>{3, 2, 4});
  CHECK(argmax(x, 0).to_vector() == std::vector<double>{1, 2, 0, 2});
  // The gradient goes to the first maximal element only.
  Tensor leaf = x.clone();
  leaf.set_requires_grad(true);
  sum(max(leaf, 1)).backward();
  CHECK(leaf.grad().to_vector() == std::vector<double>{0, 1, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0});
  double nan = std::numeric_limits<double>::quiet_NaN();
  Tensor y = from_vector({1, nan, 3, nan, 0, 2}, {2, 3}, DType::f64);
  std::vector<double> m = max(y, 1).to_vector();
  CHECK(std::isnan(m[0]));
  CHECK(std::isnan(m[1]));
  CHECK(argmax(y, 1).to_vector() == std::vector<double>{1, 0});
}

TEST_CASE("reduce: gradients over each dim", "[ops][reduce]") {
  Tensor x = randn({3, 5, 7}, DType::f64, 4);
  Tensor xd = distinct({3, 5, 7}, 5);
  for (int d = -3; d < 3; ++d)
    for (bool keepdim : {false, true}) {
      DYNAMIC_SECTION("dim " << d << " keepdim " << keepdim) {
        check_gradients([d, keepdim](const Tensors& in) { return sum(in[0], d, keepdim); }, {x});
        check_gradients([d, keepdim](const Tensors& in) { return mean(in[0], d, keepdim); }, {x});
        check_gradients([d, keepdim](const Tensors& in) { return max(in[0], d, keepdim); }, {xd});
      }
    }
  check_gradients([](const Tensors& in) { return sum(in[0]); }, {x});
  check_gradients([](const Tensors& in) { return mean(in[0]); }, {x});
  check_gradients([](const Tensors& in) { return sum(in[0], 1); }, {randn({3, 31}, DType::f64, 6)});
  // Rank 1 to rank 0.
  check_gradients([](const Tensors& in) { return sum(in[0], 0); }, {randn({31}, DType::f64, 7)});
  check_gradients([](const Tensors& in) { return mean(in[0], 0); }, {randn({31}, DType::f64, 8)});
  check_gradients([](const Tensors& in) { return max(in[0], 0); }, {distinct({31}, 9)});
}

TEST_CASE("reduce: results are bitwise the same with 1 and 2 threads", "[ops][reduce]") {
  ThreadCountGuard restore;
  // Shapes that take every kernel path in parallel: rows (inner 1), column
  // chunks (inner >= 128), many small outer blocks, and the blocked full sum.
  Tensor rows = randn({257, 1031}, DType::f32, 7);
  Tensor cols = randn({33, 517, 1}, DType::f32, 8);
  Tensor wide = randn({3, 41, 1029}, DType::f32, 9);
  Tensor d64 = randn({129, 131}, DType::f64, 10);
  auto run = [&](int threads) {
    cpu::set_num_threads(threads);
    Tensors out;
    for (const Tensor& t : {rows, wide, d64}) {
      for (int d = 0; d < t.dim(); ++d) {
        out.push_back(sum(t, d));
        out.push_back(mean(t, d, true));
        out.push_back(max(t, d));
        out.push_back(argmax(t, d));
      }
      out.push_back(sum(t));
      out.push_back(mean(t));
    }
    out.push_back(sum(cols, 1));
    // Backward too: broadcast and the max scatter.
    Tensor leaf = wide.detach().clone();
    leaf.set_requires_grad(true);
    add(sum(mul(max(leaf, 1, true), max(leaf, 2, true))), sum(leaf)).backward();
    out.push_back(leaf.grad());
    return out;
  };
  Tensors one = run(1), two = run(2);
  REQUIRE(one.size() == two.size());
  for (size_t i = 0; i < one.size(); ++i) {
    INFO("result " << i);
    CHECK(bitwise_equal(one[i], two[i]));
  }
}

TEST_CASE("reduce: bad inputs throw naming the op", "[ops][reduce][errors]") {
  Tensor x = randn({3, 4}, DType::f32, 11);
  CHECK_THROWS_AS(sum(x, 2), Error);
  CHECK_THROWS_AS(max(x, -3), Error);
  CHECK_THROWS_WITH(sum(arange(4)), Catch::Contains("sum") && Catch::Contains("i64"));
  CHECK_THROWS_WITH(sum(arange(4), 0), Catch::Contains("sum"));
  CHECK_THROWS_WITH(max(arange(4, DType::i32), 0), Catch::Contains("max"));
  CHECK_THROWS_WITH(argmax(zeros({4}, DType::u16), 0), Catch::Contains("max"));
  CHECK_THROWS_WITH(max(zeros({3, 0}), 1), Catch::Contains("max") && Catch::Contains("empty"));
  CHECK_THROWS_WITH(mean(zeros({3, 0}), 1), Catch::Contains("mean") && Catch::Contains("empty"));
  CHECK_THROWS_WITH(mean(zeros({0})), Catch::Contains("mean") && Catch::Contains("empty"));
}

TEST_CASE("reduce: sums over empty dims are zero", "[ops][reduce]") {
  Tensor s = sum(zeros({3, 0}), 1);
  REQUIRE(s.shape() == Shape{3});
  for (double v : s.to_vector()) CHECK(v == 0.0);
  CHECK(sum(zeros({0, 5})).item<double>() == 0.0);
}

namespace {
// Random values rounded to halves (ties for max to break), NaNs at `nans`.
Tensor tied_values(const Shape& shape, uint64_t seed, const std::vector<int64_t>& nans = {}) {
  std::vector<double> v = randn(shape, DType::f64, seed).to_vector();
  for (double& e : v) e = std::round(e * 2) / 2;
  for (int64_t i : nans) v[static_cast<size_t>(i)] = std::numeric_limits<double>::quiet_NaN();
  return from_vector(v, shape, DType::f64);
}
}  // namespace

TEST_CASE("sum: CUDA matches CPU over every dim and over all", "[ops][reduce][cuda]") {
  using namespace moetrain::testing;
  if (!gpu_available()) return;
  for (DType dt : {DType::f32, DType::bf16, DType::f64})
    for (int64_t n : {1, 31, 33, 257, 4099}) {
      DYNAMIC_SECTION(fmt::format("{} n={}", dt, n)) {
        Tensor x = randn({3, n, 5}, DType::f64, static_cast<uint64_t>(n));
        CudaCompare tol = tolerance_for(dt);
        for (int64_t dim : {0, 1, 2, -1})
          for (bool keep : {false, true})
            check_cuda_matches_cpu([dim, keep](const Tensors& in) { return sum(in[0], dim, keep); }, {x}, {true}, dt,
                                   tol);
        check_cuda_matches_cpu([](const Tensors& in) { return sum(in[0]); }, {x}, {true}, dt, tol);
        check_cuda_matches_cpu([](const Tensors& in) { return mean(in[0], 1); }, {x}, {true}, dt, tol);
        Tensor row = randn({n}, DType::f64, 3);  // sum_all below one block of the partial sums
        check_cuda_matches_cpu([](const Tensors& in) { return sum(in[0]); }, {row}, {true}, dt, tol);
      }
    }
  // Few outputs and a long n (a bias gradient): n cut into chunks of 256 rows, partial sums added in order.
  for (int64_t rows : {257, 4099, 300000}) {
    Tensor tall = randn({rows, 33}, DType::f64, static_cast<uint64_t>(rows));
    check_cuda_matches_cpu([](const Tensors& in) { return sum(in[0], 0); }, {tall}, {true}, DType::f32,
                           tolerance_for(DType::f32));
    Tensor tall3 = randn({2, rows, 3}, DType::f64, static_cast<uint64_t>(rows) + 1);
    check_cuda_matches_cpu([](const Tensors& in) { return sum(in[0], 1); }, {tall3}, {true}, DType::f64,
                           tolerance_for(DType::f64));
  }
  Tensor big = randn({1 << 20}, DType::f64, 4);  // sum_all over all of its partial-sum blocks
  check_cuda_matches_cpu([](const Tensors& in) { return sum(in[0]); }, {big}, {true}, DType::f32,
                         tolerance_for(DType::f32));
}

TEST_CASE("max and argmax: CUDA matches CPU, ties and NaN included", "[ops][reduce][cuda]") {
  using namespace moetrain::testing;
  if (!gpu_available()) return;
  for (DType dt : {DType::f32, DType::bf16, DType::f64})
    for (int64_t n : {1, 31, 33, 257, 4099}) {
      DYNAMIC_SECTION(fmt::format("{} n={}", dt, n)) {
        // NaNs in a few places (the first NaN along a dim wins, as on the CPU).
        Tensor x = tied_values({3, n, 5}, static_cast<uint64_t>(n) + 7, {7, 3 * n * 5 / 2, 3 * n * 5 - 1});
        CudaCompare tol = tolerance_for(dt);
        for (int64_t dim : {0, 1, 2})
          for (bool keep : {false, true}) {
            check_cuda_matches_cpu([dim, keep](const Tensors& in) { return max(in[0], dim, keep); }, {x}, {true}, dt,
                                   tol);
            Tensor ic = argmax(cpu_twin(x, dt), dim, keep), ig = argmax(cuda_twin(x, dt), dim, keep);
            REQUIRE(ig.is_cuda());
            CHECK(bitwise_equal(ig.to(kCpu), ic));
          }
      }
    }
}

TEST_CASE("count_non_finite counts NaN and both infinities in every float dtype, across blocks", "[ops][reduce]") {
  const double inf = std::numeric_limits<double>::infinity(), nan = std::numeric_limits<double>::quiet_NaN();
  const int64_t n = (1 << 16) * 3 + 17;  // several of the CPU kernel's blocks, the last one short
  const std::vector<int64_t> where = {0, (1 << 16) - 1, 1 << 16, n / 2, n - 1};
  for (DType dt : {DType::f32, DType::f64, DType::bf16}) {
    DYNAMIC_SECTION(fmt::format("{}", dt)) {
      std::vector<double> v(static_cast<size_t>(n), 1.5);
      CHECK(count_non_finite(from_vector(v, {n}, DType::f64).to(dt)) == 0);
      for (size_t i = 0; i < where.size(); ++i) v[static_cast<size_t>(where[i])] = i % 3 == 0 ? nan : i % 3 == 1 ? inf : -inf;
      v[7] = 3e38;  // large but finite in f32 and bf16
      CHECK(count_non_finite(from_vector(v, {n}, DType::f64).to(dt)) == static_cast<int64_t>(where.size()));
    }
  }
  CHECK(count_non_finite(full({4}, 3, DType::i64)) == 0);  // integers are always finite
}

TEST_CASE("find_non_finite names the first parameter with a NaN or an infinity", "[ops][reduce]") {
  ParameterList params = {{"a", full({2, 3}, 1.0, DType::f32), true, "mlp"},
                          {"b", full({4}, 2.0, DType::f32), true, "mlp"},
                          {"c", full({5}, 3.0, DType::f32), true, "mlp"}};
  CHECK(!find_non_finite(params).has_value());
  params[2].tensor.data<float>()[1] = std::numeric_limits<float>::infinity();
  params[1].tensor.data<float>()[0] = std::numeric_limits<float>::quiet_NaN();
  params[1].tensor.data<float>()[3] = std::numeric_limits<float>::quiet_NaN();
  const std::optional<NonFiniteTensor> bad = find_non_finite(params);
  REQUIRE(bad.has_value());
  CHECK(describe(*bad) == "b [4]: 2 of 4 values are NaN or infinite");
}
