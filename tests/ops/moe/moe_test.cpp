// grouped_linear (ops/moe/moe.h): one GEMM per expert over its rows.
#include <catch2/catch.hpp>

#include "moetrain.h"
#include "ops/moe/moe.h"
#include "backend/cuda/cublas.h"
#include "ops/cuda_vs_cpu.h"
#include "testing.h"

using namespace moetrain;
using moetrain::testing::check_gradients;

TEST_CASE("grouped_linear: each row uses its expert's matrix; empty experts work", "[ops][moe]") {
  // Experts 1 and 3 get no rows; expert 4 the last three.
  const std::vector<int64_t> counts = {2, 0, 4, 0, 3};
  const int64_t M = 9, in = 5, out = 3, E = 5;
  for (DType dt : {DType::f64, DType::f32}) {
    Tensor x = randn({M, in}, dt, 1), w = randn({E, out, in}, dt, 2);
    std::vector<double> y = grouped_linear(x, w, counts).to_vector();
    std::vector<double> xv = x.to_vector(), wv = w.to_vector();
    int64_t row = 0;
    for (int64_t e = 0; e < E; ++e)
      for (int64_t r = 0; r < counts[e]; ++r, ++row)
        for (int64_t o = 0; o < out; ++o) {
          double ref = 0;
          for (int64_t i = 0; i < in; ++i) ref += xv[row * in + i] * wv[(e * out + o) * in + i];
          CHECK(y[row * out + o] == Approx(ref).epsilon(dt == DType::f64 ? 1e-13 : 1e-5).margin(1e-6));
        }
  }
  // No rows at all.
  Tensor y0 = grouped_linear(empty({0, in}, DType::f64), randn({E, out, in}, DType::f64, 3), {0, 0, 0, 0, 0});
  CHECK(y0.shape() == Shape{0, out});
}

TEST_CASE("grouped_linear: gradients match finite differences (zero-row experts get zero gradient)", "[ops][moe]") {
  const std::vector<int64_t> counts = {3, 0, 1, 4};
  Tensor x = randn({8, 6}, DType::f64, 4), w = randn({4, 5, 6}, DType::f64, 5);
  check_gradients([&](const Tensors& in) { return grouped_linear(in[0], in[1], counts); }, {x, w});
  Tensor wl = randn({4, 5, 6}, DType::f64, 6);
  wl.set_requires_grad(true);
  sum(grouped_linear(x, wl, counts)).backward();
  std::vector<double> g = wl.grad().to_vector();
  for (int64_t i = 30; i < 60; ++i) CHECK(g[i] == 0.0);  // expert 1
}

TEST_CASE("grouped_linear: bad shapes are named", "[ops][moe]") {
  Tensor x = randn({4, 3}, DType::f64, 1), w = randn({2, 5, 3}, DType::f64, 2);
  CHECK_THROWS_WITH(grouped_linear(x, w, {1, 2}), Catch::Contains("row counts sum to 3") && Catch::Contains("[4, 3]"));
  CHECK_THROWS_WITH(grouped_linear(x, w, {4}), Catch::Contains("1 row counts for w [2, 5, 3]"));
  CHECK_THROWS_WITH(grouped_linear(x, randn({2, 5, 4}, DType::f64, 3), {2, 2}), Catch::Contains("w must be [E, out, 3]"));
}

TEST_CASE("grouped_linear: CUDA matches CPU, experts without rows included", "[ops][moe][cuda]") {
  if (!moetrain::testing::gpu_available()) return;
  std::vector<int64_t> counts = {5, 0, 33, 1, 0, 17};
  Tensor x = randn({56, 65}, DType::f32, 1).set_requires_grad();
  Tensor w = randn({6, 31, 65}, DType::f32, 2).set_requires_grad();
  auto fn = [counts](const Tensors& in) { return Tensors{grouped_linear(in[0], in[1], counts)}; };
  for (DType dtype : {DType::f32, DType::f64, DType::bf16})  // f32, bf16: one grouped call; f64: a GEMM per expert
    moetrain::testing::check_cuda_matches_cpu(fn, {x, w}, {true, true}, dtype, moetrain::testing::tolerance_for(dtype));
  // TF32 products (10-bit mantissas) through the grouped call, or its per-expert fallback.
  cuda::set_allow_tf32(true);
  moetrain::testing::check_cuda_matches_cpu(fn, {x, w}, {true, true}, DType::f32, {5e-3, 5e-3});
  cuda::set_allow_tf32(false);
}
