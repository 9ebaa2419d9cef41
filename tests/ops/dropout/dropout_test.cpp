#include <catch2/catch.hpp>

#include "moetrain.h"
#include "ops/dropout/dropout.h"
#include "ops/cuda_vs_cpu.h"
#include "testing.h"

using namespace moetrain;

TEST_CASE("dropout: keeps about 1-p of the elements, scaled by 1/(1-p)", "[ops][dropout]") {
  Tensor x = ones({200, 100}, DType::f64);
  x.set_requires_grad(true);
  Generator gen(7);
  std::vector<double> y = dropout(x, 0.25, &gen).to_vector();
  int64_t kept = 0;
  for (double v : y) {
    REQUIRE((v == 0.0 || v == Approx(1.0 / 0.75)));
    kept += v != 0.0;
  }
  CHECK(kept / 20000.0 == Approx(0.75).margin(0.01));
}

TEST_CASE("dropout: backward applies the same mask (finite differences)", "[ops][dropout]") {
  Tensor x = randn({3, 37}, DType::f64, 1);
  // A fresh generator per call: every evaluation draws the same mask.
  moetrain::testing::check_gradients(
      [](const Tensors& in) {
        Generator gen(3);
        return dropout(in[0], 0.3, &gen);
      },
      {x});
}

TEST_CASE("dropout: identity for p = 0; bad p is reported", "[ops][dropout]") {
  Tensor x = randn({4, 5}, DType::f32, 1);
  x.set_requires_grad(true);
  CHECK(dropout(x, 0.0).same_storage(x));
  CHECK_THROWS_WITH(dropout(x, 1.0), Catch::Contains("dropout") && Catch::Contains("[0, 1)"));
}

TEST_CASE("dropout: CUDA draws the CPU's mask (same Philox stream), forward and backward",
          "[ops][dropout][cuda]") {
  if (!moetrain::testing::gpu_available()) return;
  Tensor x = randn({33, 257}, DType::f32, 4).set_requires_grad();
  auto fn = [](const Tensors& in) {
    Generator g(99);
    g.set_offset(12345);
    return Tensors{dropout(in[0], 0.3, &g)};
  };
  moetrain::testing::check_cuda_matches_cpu(fn, {x}, {true}, DType::f32, {0.0, 0.0});  // the same mask: exact
}
