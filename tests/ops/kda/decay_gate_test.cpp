#include <cmath>
#include <optional>

#include <catch2/catch.hpp>

#include "moetrain.h"
#include "testing.h"
#include "ops/cuda_vs_cpu.h"

using namespace moetrain;
using moetrain::testing::check_gradients;

namespace {
double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }
double softplus(double x) { return std::log1p(std::exp(x)); }

// f [2, 5, H, K] spread over both tails of softplus and σ, A_log [H], dt_bias [H·K].
struct GateInputs {
  Tensor f, A_log, dt_bias;
};
GateInputs gate_inputs(int64_t H, int64_t K, uint64_t seed) {
  return {mul_scalar(randn({2, 5, H, K}, DType::f64, seed), 4.0), mul_scalar(randn({H}, DType::f64, seed + 1), 0.7),
          randn({H * K}, DType::f64, seed + 2)};
}
}  // namespace

TEST_CASE("decay_gate: forward matches docs/model.md#decay-gate for both gates", "[ops][decay_gate]") {
  const int64_t H = 3, K = 7;
  GateInputs in = gate_inputs(H, K, 1);
  std::vector<double> f = in.f.to_vector(), A = in.A_log.to_vector(), b = in.dt_bias.to_vector();
  std::vector<double> soft = decay_gate(in.f, in.A_log, in.dt_bias, std::nullopt).to_vector();
  std::vector<double> safe = decay_gate(in.f, in.A_log, in.dt_bias, -5.0).to_vector();
  for (size_t i = 0; i < f.size(); ++i) {
    const size_t c = i % static_cast<size_t>(H * K), h = c / static_cast<size_t>(K);
    const double a = std::exp(A[h]), u = f[i] + b[c];
    REQUIRE(soft[i] == Approx(-a * softplus(u)).epsilon(1e-13).margin(1e-15));
    REQUIRE(safe[i] == Approx(-5.0 * sigmoid(a * u)).epsilon(1e-13).margin(1e-15));
    REQUIRE(safe[i] > -5.0);
    REQUIRE(soft[i] < 0.0);
  }
}

TEST_CASE("decay_gate: gradients match finite differences", "[ops][decay_gate]") {
  for (int64_t K : {1, 6}) {
    GateInputs in = gate_inputs(2, K, 10 + static_cast<uint64_t>(K));
    check_gradients([](const Tensors& t) { return decay_gate(t[0], t[1], t[2], std::nullopt); },
                    {in.f, in.A_log, in.dt_bias});
    check_gradients([](const Tensors& t) { return decay_gate(t[0], t[1], t[2], -5.0); }, {in.f, in.A_log, in.dt_bias});
  }
}

TEST_CASE("decay_gate: f32 agrees with f64, and only the needed gradients are made", "[ops][decay_gate]") {
  GateInputs in = gate_inputs(4, 33, 20);
  for (std::optional<double> lb : {std::optional<double>(), std::optional<double>(-5.0)}) {
    Tensor g64 = decay_gate(in.f, in.A_log, in.dt_bias, lb);
    Tensor g32 = decay_gate(in.f.to(DType::f32), in.A_log.to(DType::f32), in.dt_bias.to(DType::f32), lb);
    CHECK(testing::max_abs_diff(g32.to(DType::f64), g64) < 1e-5 * (1.0 + testing::max_abs_diff(g64, zeros_like(g64))));
  }
  Tensor f = in.f.detach().clone(), A = in.A_log.detach().clone(), b = in.dt_bias.detach().clone();
  b.set_requires_grad(true);  // A_log frozen, f a constant: only dt_bias gets a gradient
  sum(decay_gate(f, A, b, -5.0)).backward();
  CHECK(b.grad().defined());
  CHECK(b.grad().shape() == Shape{4 * 33});
  CHECK_FALSE(A.grad().defined());
}

TEST_CASE("decay_gate: bad shapes and bounds are reported", "[ops][decay_gate][errors]") {
  Tensor f = randn({2, 3, 4}, DType::f32, 1), A = randn({3}, DType::f32, 2), b = randn({12}, DType::f32, 3);
  CHECK_THROWS_WITH(decay_gate(f, randn({4}, DType::f32, 4), b, std::nullopt),
                    Catch::Contains("decay_gate") && Catch::Contains("A_log") && Catch::Contains("[2, 3, 4]"));
  CHECK_THROWS_WITH(decay_gate(f, A, randn({3, 4}, DType::f32, 5), std::nullopt),
                    Catch::Contains("dt_bias") && Catch::Contains("[12]"));
  CHECK_THROWS_WITH(decay_gate(f, A, b, 0.0), Catch::Contains("lower bound"));
  CHECK_THROWS_WITH(decay_gate(f, A.to(DType::f64), b, std::nullopt), Catch::Contains("decay_gate"));
  CHECK_THROWS_WITH(decay_gate(randn({5}, DType::f32, 6), A, b, std::nullopt), Catch::Contains("decay_gate"));
}

// CUDA twin: forward and every gradient against the CPU kernel, element counts off
// the block size, both gates, K = 1 (Gated DeltaNet) and K = 128.
TEST_CASE("decay_gate: CUDA matches CPU", "[ops][decay_gate][cuda]") {
  using namespace moetrain::testing;
  if (!gpu_available()) return;
  for (DType dt : {DType::f32, DType::bf16, DType::f64})
    for (int64_t K : {1, 33, 128}) {
      DYNAMIC_SECTION(fmt::format("{} K={}", dt, K)) {
        GateInputs in = gate_inputs(3, K, 30 + static_cast<uint64_t>(K));
        CudaCompare tol = tolerance_for(dt);
        check_cuda_matches_cpu([](const Tensors& t) { return Tensors{decay_gate(t[0], t[1], t[2], std::nullopt)}; },
                               {in.f, in.A_log, in.dt_bias}, {true, true, true}, dt, tol);
        check_cuda_matches_cpu([](const Tensors& t) { return Tensors{decay_gate(t[0], t[1], t[2], -5.0)}; },
                               {in.f, in.A_log, in.dt_bias}, {true, true, true}, dt, tol);
      }
    }
}
