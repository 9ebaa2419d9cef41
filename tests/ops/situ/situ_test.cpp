#include <cmath>
#include <optional>

#include <catch2/catch.hpp>

#include "moetrain.h"
#include "backend/cpu/isa.h"
#include "testing.h"
#include "ops/cuda_vs_cpu.h"

using namespace moetrain;
using moetrain::testing::check_gradients;

namespace {
double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }
}  // namespace

TEST_CASE("situ_glu: forward matches docs/model.md#situ-glu", "[ops][situ]") {
  Tensor gate = randn({3, 37}, DType::f64, 1), up = randn({3, 37}, DType::f64, 2);
  // Spread the inputs well past the caps so both tanh regimes are exercised.
  gate = mul_scalar(gate, 6.0);
  up = mul_scalar(up, 40.0);
  std::vector<double> g = gate.to_vector(), u = up.to_vector();
  std::vector<double> capped = situ_glu(gate, up, 4.0, 25.0).to_vector();
  std::vector<double> uncapped = situ_glu(gate, up, 4.0, std::nullopt).to_vector();
  for (size_t i = 0; i < g.size(); ++i) {
    double a = 4.0 * std::tanh(g[i] / 4.0) * sigmoid(g[i]);
    REQUIRE(capped[i] == Approx(a * 25.0 * std::tanh(u[i] / 25.0)).epsilon(1e-13).margin(1e-14));
    REQUIRE(uncapped[i] == Approx(a * u[i]).epsilon(1e-13).margin(1e-14));
  }
  // Large β turns the gate into SiLU.
  std::vector<double> silu_like = situ_glu(gate, up, 1e6, std::nullopt).to_vector();
  for (size_t i = 0; i < g.size(); ++i)
    REQUIRE(silu_like[i] == Approx(g[i] * sigmoid(g[i]) * u[i]).epsilon(1e-9).margin(1e-9));
}

TEST_CASE("situ_glu: gradients match finite differences", "[ops][situ]") {
  // Inputs reach past both caps (|gate| ~ 10 > beta, |up| ~ 60 > lambda); outputs
  // near beta * lambda = 100 make the rounding error of a 1e-6 step ~1e-8, so step 1e-5.
  Tensor gate = mul_scalar(randn({4, 33}, DType::f64, 3), 5.0), up = mul_scalar(randn({4, 33}, DType::f64, 4), 30.0);
  testing::GradCheckOptions opts;
  opts.eps = 1e-5;
  check_gradients([](const Tensors& in) { return situ_glu(in[0], in[1], 4.0, 25.0); }, {gate, up}, opts);
  check_gradients([](const Tensors& in) { return situ_glu(in[0], in[1], 2.5, std::nullopt); }, {gate, up}, opts);
  // Learnable β (with and without the linear cap).
  Tensor beta = full({1}, 4.0, DType::f64);
  check_gradients([](const Tensors& in) { return situ_glu(in[0], in[1], in[2], 25.0); }, {gate, up, beta}, opts);
  check_gradients([](const Tensors& in) { return situ_glu(in[0], in[1], in[2], std::nullopt); }, {gate, up, beta},
                  opts);
}

TEST_CASE("situ_glu: f32 agrees with f64", "[ops][situ]") {
  Tensor gate = mul_scalar(randn({8, 129}, DType::f64, 5), 5.0), up = mul_scalar(randn({8, 129}, DType::f64, 6), 30.0);
  Tensor y64 = situ_glu(gate, up, 4.0, 25.0);
  Tensor y32 = situ_glu(gate.to(DType::f32), up.to(DType::f32), 4.0, 25.0);
  REQUIRE(testing::max_abs_diff(y32.to(DType::f64), y64) < 1e-4);  // |y| <= 4·25; f32 ulp at 100 is 8e-6
}

TEST_CASE("situ_glu: every vector copy agrees with the f64 result; the FMA copies give the same bits", "[ops][situ]") {
  // ops/situ/situ_cpu.cpp compiles the loops portable, AVX2 + FMA and AVX-512; the same
  // scalar expression per element in each, so the two FMA copies must agree bit for bit
  // (lanes are elements), and every copy with the f64 forward and backward.
  Tensor gate = mul_scalar(randn({7, 1031}, DType::f64, 7), 5.0), up = mul_scalar(randn({7, 1031}, DType::f64, 8), 30.0);
  Tensor dy = randn({7, 1031}, DType::f64, 9);
  auto run = [&](DType dt) {
    Tensor g = gate.to(dt).detach().set_requires_grad(), u = up.to(dt).detach().set_requires_grad();
    Tensor b = full({1}, 4.0, dt);
    b.set_requires_grad(true);
    Tensor y = situ_glu(g, u, b, 25.0);
    autograd::backward({y}, {dy.to(dt)});
    return std::vector<Tensor>{y, g.grad(), u.grad(), b.grad()};
  };
  moetrain::testing::check_vector_copies(run, 1e-5);
}

TEST_CASE("situ_glu: bad input is reported", "[ops][situ][errors]") {
  Tensor a = randn({2, 3}, DType::f32, 1), b = randn({2, 4}, DType::f32, 2);
  CHECK_THROWS_WITH(situ_glu(a, b, 4.0, 25.0), Catch::Contains("situ_glu") && Catch::Contains("[2, 4]"));
  CHECK_THROWS_WITH(situ_glu(a, a, 0.0, 25.0), Catch::Contains("beta"));
  CHECK_THROWS_WITH(situ_glu(a, a, 4.0, -1.0), Catch::Contains("linear_beta"));
  CHECK_THROWS_WITH(situ_glu(a, a, full({2}, 4.0), 25.0), Catch::Contains("one-element"));
}

TEST_CASE("situ_glu: CUDA matches CPU, fixed and learnable beta, with and without the cap", "[ops][situ][cuda]") {
  using namespace moetrain::testing;
  if (!gpu_available()) return;
  for (DType dt : {DType::f32, DType::bf16, DType::f64})
    for (int64_t cols : {1, 31, 33, 257, 4099})
      for (std::optional<double> cap : {std::optional<double>{}, std::optional<double>{2.5}}) {
        DYNAMIC_SECTION(fmt::format("{} cols={} cap={}", dt, cols, cap.value_or(0))) {
          Tensor gate = mul_scalar(randn({9, cols}, DType::f64, static_cast<uint64_t>(cols)), 3.0);
          Tensor up = mul_scalar(randn({9, cols}, DType::f64, static_cast<uint64_t>(cols) + 1), 3.0);
          Tensor beta = full({1}, 1.3, DType::f64);
          CudaCompare tol = tolerance_for(dt);
          check_cuda_matches_cpu([cap](const Tensors& in) { return situ_glu(in[0], in[1], 0.8, cap); }, {gate, up},
                                 {true, true}, dt, tol);
          // The β gradient is a sum over every element: relative to its own size.
          check_cuda_matches_cpu([cap](const Tensors& in) { return situ_glu(in[0], in[1], in[2], cap); },
                                 {gate, up, beta}, {true, true, true}, dt, tol);
        }
      }
  Tensor gate = randn({1 << 19}, DType::f64, 1), up = randn({1 << 19}, DType::f64, 2), beta = full({1}, 0.9, DType::f64);
  check_cuda_matches_cpu([](const Tensors& in) { return situ_glu(in[0], in[1], in[2], std::nullopt); },
                         {gate, up, beta}, {true, true, true}, DType::f32, tolerance_for(DType::f32));
}
