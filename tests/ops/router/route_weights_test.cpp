// renormalize_rows (ops/router/route_weights.h): the router's weight renormalisation
// as one op equals the sequence it replaced (div(w, add_scalar(sum(w, -1), eps))) in
// values and gradients, its gradient matches float64 finite differences, bad
// arguments are refused, and it launches fewer kernels than the sequence. The CPU
// kernel runs the row arithmetic the CUDA kernel runs (route_weights_simt.h).
#include <catch2/catch.hpp>

#include "core/launch_count.h"
#include "moetrain.h"
#include "ops/cuda_vs_cpu.h"
#include "ops/router/route_weights.h"
#include "testing.h"

using namespace moetrain;
using moetrain::testing::check_gradients;
using moetrain::testing::rel_error;

namespace {

struct RowsRun {
  Tensor y, grad_w;
};
template <class F>
RowsRun run_rows(F fn, const Tensor& w0, const Tensor& g) {
  Tensor w = w0.detach().set_requires_grad();
  Tensor y = fn(w);
  autograd::backward({y}, {g});
  return {y.detach(), w.grad()};
}

Tensor fused_rows(const Tensor& w) { return renormalize_rows(w, 1e-20); }
Tensor plain_rows(const Tensor& w) { return div(w, add_scalar(sum(w, -1, true), 1e-20)); }

// Router weights: sigmoid scores, so positive, k per row.
Tensor weights(int64_t N, int64_t k, uint64_t seed) { return sigmoid(randn({N, k}, DType::f64, seed)); }

}  // namespace

TEST_CASE("renormalize_rows: equals div(w, sum(w) + eps) in values and gradients", "[ops][router]") {
  for (int64_t k : {1, 2, 8, 33}) {
    Tensor w = weights(37, k, 1), g = randn({37, k}, DType::f64, 2);
    // f64 and f32: the same divisions; the sum's order may differ (the unfused sum
    // runs in lanes), the backward's formula differs (one fused expression).
    for (auto [dt, tol] : {std::pair{DType::f64, 1e-14}, std::pair{DType::f32, 1e-6}}) {
      DYNAMIC_SECTION(dtype_name(dt) << " k " << k) {
        RowsRun fused = run_rows(fused_rows, w.to(dt), g.to(dt));
        RowsRun plain = run_rows(plain_rows, w.to(dt), g.to(dt));
        CHECK(fused.y.dtype() == dt);
        CHECK(rel_error(fused.y.to(DType::f64), plain.y.to(DType::f64)) <= tol);
        CHECK(rel_error(fused.grad_w.to(DType::f64), plain.grad_w.to(DType::f64)) <= tol);
      }
    }
  }
  // Each row sums to 1 (up to the eps).
  const std::vector<double> y = fused_rows(weights(5, 8, 3)).to_vector();
  for (int r = 0; r < 5; ++r) {
    double s = 0;
    for (int j = 0; j < 8; ++j) s += y[static_cast<size_t>(r * 8 + j)];
    CHECK(s == Approx(1.0).epsilon(1e-15));
  }
}

TEST_CASE("renormalize_rows: gradients match finite differences", "[ops][router]") {
  check_gradients([](const Tensors& in) { return renormalize_rows(in[0], 0.25); }, {weights(4, 8, 4)});
  check_gradients([](const Tensors& in) { return renormalize_rows(in[0], 0.0); }, {weights(3, 5, 5)});
}

TEST_CASE("renormalize_rows: bad arguments are refused naming the op", "[ops][router]") {
  Tensor w = weights(2, 4, 6);
  CHECK_THROWS_WITH(renormalize_rows(w, -1.0), Catch::Contains("renormalize_rows") && Catch::Contains("eps"));
  CHECK_THROWS_WITH(renormalize_rows(w, std::nan("")), Catch::Contains("renormalize_rows"));
  CHECK_THROWS_WITH(renormalize_rows(empty({2, 0}, DType::f64), 0.0), Catch::Contains("renormalize_rows"));
}

TEST_CASE("renormalize_rows: one launch forward and one backward, where the sequence takes more", "[ops][router]") {
  Tensor w = weights(16, 8, 7).to(DType::f32), g = randn({16, 8}, DType::f32, 8);
  auto count = [&](auto fn) {
    const LaunchCounts before = launch_counts();
    run_rows(fn, w, g);
    return (launch_counts() - before).cpu_kernels;
  };
  const int64_t plain = count(plain_rows), fused = count(fused_rows);
  INFO("sequence " << plain << ", fused " << fused);
  // sum, add_scalar, div; backward: g / b, (g / b) y, its negation, the sum to b's
  // shape, sum's broadcast back, the two uses of w added
  CHECK(plain >= 8);
  CHECK(fused == 2);
}

TEST_CASE("renormalize_rows: CUDA matches CPU", "[ops][router][cuda]") {
  using namespace moetrain::testing;
  if (!gpu_available()) return;
  for (DType dt : {DType::f32, DType::bf16, DType::f64})
    for (int64_t k : {1, 8, 33}) {
      DYNAMIC_SECTION(dtype_name(dt) << " k " << k) {
        check_cuda_matches_cpu([](const Tensors& in) { return renormalize_rows(in[0], 1e-20); }, {weights(1000, k, 9)},
                               {true}, dt, tolerance_for(dt));
      }
    }
}
