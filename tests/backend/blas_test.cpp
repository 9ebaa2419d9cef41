// The f32 GEMM routes (backend/cpu/blas.h): OpenBLAS and BLIS against an f64 loop,
// every transpose combination, padded leading dimensions, alpha and beta, inside
// our own parallel regions, and through the matmul op; the route's environment
// variable and what `moetrain info` reports.
#include <catch2/catch.hpp>

#include <cmath>
#include <vector>

#include "backend/cpu/blas.h"
#include "backend/cpu/parallel.h"
#include "core/rng.h"
#include "moetrain.h"
#include "testing.h"

using namespace moetrain;

namespace {

// Restores the process's route when a test switches it.
struct RouteGuard {
  cpu::GemmRoute saved = cpu::gemm_route();
  ~RouteGuard() { cpu::set_gemm_route(saved); }
};

std::vector<cpu::GemmRoute> routes() {
  std::vector<cpu::GemmRoute> r{cpu::GemmRoute::openblas};
  if (cpu::blis_available()) r.insert(r.end(), {cpu::GemmRoute::blis, cpu::GemmRoute::blis_threaded});
  else WARN("BLIS (libblis4-openmp) is not installed: only the OpenBLAS route is tested");
  return r;
}

// C = alpha op(A) op(B) + beta C in f64 with row-major, padded operands; returns
// the largest error relative to Σ|alpha a b| + |beta c| of its element.
double gemm_error(bool ta, bool tb, int64_t m, int64_t n, int64_t k, uint64_t seed) {
  const int64_t lda = (ta ? m : k) + 3, ldb = (tb ? k : n) + 5, ldc = n + 2;
  const int64_t arows = ta ? k : m, brows = tb ? n : k;
  Generator gen(seed);
  std::vector<float> a(static_cast<size_t>(arows * lda)), b(static_cast<size_t>(brows * ldb)),
      c(static_cast<size_t>(m * ldc));
  uint64_t counter = 0;
  for (auto* v : {&a, &b, &c})
    for (float& x : *v) x = static_cast<float>(gen.normal(counter++));
  const std::vector<float> c0 = c;
  const float alpha = 0.7f, beta = 0.3f;
  cpu::gemm(ta, tb, m, n, k, alpha, a.data(), lda, b.data(), ldb, beta, c.data(), ldc);
  double worst = 0;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double ref = beta * static_cast<double>(c0[i * ldc + j]), mag = std::abs(ref);
      for (int64_t p = 0; p < k; ++p) {
        double x = ta ? a[p * lda + i] : a[i * lda + p], y = tb ? b[j * ldb + p] : b[p * ldb + j];
        ref += alpha * x * y;
        mag += std::abs(alpha * x * y);
      }
      worst = std::max(worst, std::abs(c[i * ldc + j] - ref) / mag);
    }
  // Padding columns of C are untouched.
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = n; j < ldc; ++j) REQUIRE(c[i * ldc + j] == c0[i * ldc + j]);
  return worst;
}

}  // namespace

TEST_CASE("blas: every f32 GEMM route matches an f64 loop (transposes, padding, alpha, beta)", "[backend][blas]") {
  RouteGuard guard;
  for (cpu::GemmRoute route : routes()) {
    cpu::set_gemm_route(route);
    for (bool ta : {false, true})
      for (bool tb : {false, true})
        for (auto [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{37, 53, 29}, {1, 7, 300}, {300, 257, 190}}) {
          INFO("route " << cpu::gemm_route_name(route) << " ta " << ta << " tb " << tb
                        << " m " << m << " n " << n << " k " << k);
          CHECK(gemm_error(ta, tb, m, n, k, static_cast<uint64_t>(m * 7 + n + ta * 2 + tb)) < 1e-6);
        }
  }
}

TEST_CASE("blas: GEMMs issued from inside our parallel regions (one per thread) are right on every route",
          "[backend][blas]") {
  RouteGuard guard;
  for (cpu::GemmRoute route : routes()) {
    cpu::set_gemm_route(route);
    std::vector<double> errors(8, 1.0);
    cpu::parallel_for(8, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t)
        errors[static_cast<size_t>(t)] = gemm_error(t % 2 == 1, t % 4 >= 2, 64, 64, 64, static_cast<uint64_t>(t));
    });
    for (double e : errors) CHECK(e < 1e-6);
  }
}

TEST_CASE("blas: matmul and linear give the same results on both routes (to f32 rounding)", "[backend][blas]") {
  if (!cpu::blis_available()) {
    WARN("BLIS is not installed: skipped");
    return;
  }
  RouteGuard guard;
  Tensor x = randn({3, 70, 96}, DType::f32, 1), w = randn({130, 96}, DType::f32, 2);
  cpu::set_gemm_route(cpu::GemmRoute::openblas);
  Tensor a = linear(x, w), b = matmul(x, transpose(w, 0, 1));
  cpu::set_gemm_route(cpu::GemmRoute::blis);
  Tensor c = linear(x, w), d = matmul(x, transpose(w, 0, 1));
  CHECK(moetrain::testing::max_abs_diff(a, c) < 1e-4);
  CHECK(moetrain::testing::max_abs_diff(b, d) < 1e-4);
}

TEST_CASE("blas: the blis route splits C over the threads: right, and the same bits for any thread count",
          "[backend][blas]") {
  if (!cpu::blis_available()) {
    WARN("BLIS is not installed: skipped");
    return;
  }
  RouteGuard guard;
  const int saved_threads = cpu::num_threads();
  cpu::set_gemm_route(cpu::GemmRoute::blis);
  // Large enough to be split (backend/cpu/blas.cpp: >= 2M multiply-adds per thread),
  // sizes off the 12-row and 32-column cuts; one tall, one wide, one square-ish with
  // k below BLIS's sup threshold (201 on haswell), one above it in every dimension.
  // Under MOETRAIN_GEMM=portable this runs BLIS's haswell kernels.
  for (auto [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{1001, 67, 257}, {37, 3001, 190}, {301, 333, 129},
                         {450, 700, 300}}) {
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        INFO("m " << m << " n " << n << " k " << k << " ta " << ta << " tb " << tb);
        Tensor a = randn(ta ? Shape{k, m} : Shape{m, k}, DType::f32, 1);
        Tensor b = randn(tb ? Shape{n, k} : Shape{k, n}, DType::f32, 2);
        Tensor c0 = randn({m, n}, DType::f32, 3);
        std::vector<Tensor> results;
        for (int threads : {1, 2, 3, 4, 7}) {
          cpu::set_num_threads(threads);
          Tensor c = c0.clone();
          cpu::gemm(ta, tb, m, n, k, 0.5f, a.data<float>(), a.size(1), b.data<float>(), b.size(1), 0.25f,
                    c.data<float>(), n);
          results.push_back(c);
        }
        cpu::set_num_threads(saved_threads);
        for (size_t i = 1; i < results.size(); ++i) CHECK(moetrain::testing::max_abs_diff(results[0], results[i]) == 0);
        CHECK(gemm_error(ta, tb, m, n, k, static_cast<uint64_t>(m + n + k)) < 1e-6);
      }
  }
  cpu::set_num_threads(saved_threads);
}

TEST_CASE("blas: MOETRAIN_GEMM picks the route; a bad value is an error naming the variable", "[backend][blas]") {
  auto info = moetrain::testing::run_moetrain("info");
  REQUIRE(info.code == 0);
  CHECK_THAT(info.output, Catch::Contains("f32 GEMM: "));
  const std::string info_cmd = std::string(MOETRAIN_BINARY_DIR) + "/moetrain info";
  auto forced = moetrain::testing::capture_command(std::string("MOETRAIN_GEMM=openblas ") + info_cmd);
  CHECK_THAT(forced.output, Catch::Contains("f32 GEMM: openblas"));
  auto bad = moetrain::testing::capture_command(std::string("MOETRAIN_GEMM=mkl ") + info_cmd);
  CHECK(bad.code != 0);
  CHECK_THAT(bad.output, Catch::Contains("MOETRAIN_GEMM=mkl") &&
                             Catch::Contains("auto, openblas, blis, blis-threaded, portable"));
  // info names the route and how it runs on threads.
  CHECK_THAT(forced.output, Catch::Contains("f32 gemm    openblas (MOETRAIN_GEMM=openblas): OpenBLAS's own OpenMP"));
  if (cpu::blis_available()) {
    auto blis = moetrain::testing::capture_command(std::string("MOETRAIN_GEMM=blis ") + info_cmd);
    CHECK(blis.code == 0);
    CHECK_THAT(blis.output, Catch::Contains("f32 GEMM: blis ("));
    CHECK_THAT(blis.output, Catch::Contains("f32 gemm    blis (MOETRAIN_GEMM=blis): moetrain's OpenMP regions"));
    auto threaded = moetrain::testing::capture_command(std::string("MOETRAIN_GEMM=blis-threaded ") + info_cmd);
    CHECK(threaded.code == 0);
    CHECK_THAT(threaded.output, Catch::Contains("f32 GEMM: blis-threaded (") &&
                                    Catch::Contains("BLIS's own OpenMP threads"));
    // portable: BLIS's AVX2 + FMA kernels whatever the CPU has beyond them.
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
      auto portable = moetrain::testing::capture_command(std::string("BLIS_ARCH_TYPE=0 MOETRAIN_GEMM=portable ") +
                                                         info_cmd);
      CHECK(portable.code == 0);
      CHECK_THAT(portable.output, Catch::Contains("f32 GEMM: blis (haswell)") &&
                                      Catch::Contains("f32 gemm    blis (MOETRAIN_GEMM=portable)"));
    }
  }
}
