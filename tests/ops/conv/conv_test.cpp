#include <catch2/catch.hpp>

#include "moetrain.h"
#include "ops/cuda_vs_cpu.h"
#include "testing.h"

using namespace moetrain;
using moetrain::testing::check_gradients;

TEST_CASE("causal_conv1d: forward matches the docs/model.md formula", "[ops][conv]") {
  const int B = 2, T = 9, C = 5, W = 4;
  Tensor x = randn({B, T, C}, DType::f64, 1), w = randn({C, W}, DType::f64, 2);
  std::vector<double> vx = x.to_vector(), vw = w.to_vector(), y = causal_conv1d(x, w).to_vector();
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t)
      for (int c = 0; c < C; ++c) {
        double ref = 0;
        for (int i = 0; i < W; ++i) {
          int s = t - (W - 1) + i;
          if (s >= 0) ref += vw[c * W + i] * vx[(b * T + s) * C + c];
        }
        REQUIRE(y[(b * T + t) * C + c] == Approx(ref).epsilon(1e-13).margin(1e-15));
      }
}

TEST_CASE("causal_conv1d: gradients match finite differences", "[ops][conv]") {
  Tensor x = randn({2, 7, 33}, DType::f64, 3), w = randn({33, 4}, DType::f64, 4);
  check_gradients([](const Tensors& in) { return causal_conv1d(in[0], in[1]); }, {x, w});
  Tensor short_x = randn({1, 2, 3}, DType::f64, 5), w3 = randn({3, 4}, DType::f64, 6);  // T < W
  check_gradients([](const Tensors& in) { return causal_conv1d(in[0], in[1]); }, {short_x, w3});
}

TEST_CASE("causal_conv1d: bad shapes are reported", "[ops][conv][errors]") {
  CHECK_THROWS_WITH(causal_conv1d(randn({2, 3, 4}, DType::f32, 1), randn({5, 4}, DType::f32, 2)),
                    Catch::Contains("causal_conv1d") && Catch::Contains("[5, 4]"));
  CHECK_THROWS_WITH(causal_conv1d(randn({3, 4}, DType::f32, 1), randn({4, 4}, DType::f32, 2)),
                    Catch::Contains("rank 3"));
}

TEST_CASE("causal_conv1d: CUDA matches CPU, forward and both gradients", "[ops][conv][cuda]") {
  if (!moetrain::testing::gpu_available()) return;
  for (DType dtype : {DType::f32, DType::f64, DType::bf16}) {
    for (int64_t W : {1, 4, 7}) {
      // 2 x 257 rows (chunks of 128 plus a remainder), 33 channels.
      Tensor x = randn({2, 257, 33}, DType::f32, 1), w = randn({33, W}, DType::f32, 2);
      moetrain::testing::check_cuda_matches_cpu(
          [](const Tensors& in) { return Tensors{causal_conv1d(in[0], in[1])}; },
          {dtype == DType::f64 ? x.to(DType::f64) : x, dtype == DType::f64 ? w.to(DType::f64) : w}, {true, true},
          dtype, moetrain::testing::tolerance_for(dtype));
    }
  }
}
