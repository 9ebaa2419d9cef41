// sigmoid_gate (ops/elementwise/sigmoid_gate.h): the fused output gate equals the
// unfused sequence it replaced (mul(x, sigmoid(z))) in its values and gradients, its
// gradients match float64 finite differences, the CUDA kernels' per-element arithmetic
// (sigmoid_gate_simt.h, run here on the host) gives the unfused CUDA kernels' bits, and
// it launches fewer kernels than the sequence (core/launch_count.h).
#include <cmath>
#include <tuple>
#include <vector>

#include <catch2/catch.hpp>

#include "core/launch_count.h"
#include "moetrain.h"
#include "ops/cuda_vs_cpu.h"
#include "ops/elementwise/sigmoid_gate.h"
#include "ops/elementwise/sigmoid_gate_simt.h"
#include "testing.h"

using namespace moetrain;
using moetrain::testing::check_gradients;
using moetrain::testing::rel_error;

namespace {

// y and both gradients of fn(x, z) for upstream gradient g, in x's dtype.
struct GateRun {
  Tensor y, grad_x, grad_z;
};
template <class F>
GateRun run_gate(F fn, const Tensor& x0, const Tensor& z0, const Tensor& g) {
  Tensor x = x0.detach().set_requires_grad(), z = z0.detach().set_requires_grad();
  Tensor y = fn(x, z);
  autograd::backward({y}, {g});
  return {y.detach(), x.grad(), z.grad()};
}

}  // namespace

TEST_CASE("sigmoid_gate: equals mul(x, sigmoid(z)) in values and gradients", "[ops][elementwise]") {
  // Gates far into both tails (|z| up to ~20) and near 0; sizes off the vector width.
  auto fused_fn = [](const Tensor& a, const Tensor& b) { return sigmoid_gate(a, b); };
  auto plain_fn = [](const Tensor& a, const Tensor& b) { return mul(a, sigmoid(b)); };
  for (int64_t cols : {1, 31, 33, 257}) {
    Tensor x = randn({5, cols}, DType::f64, 1), z = mul_scalar(randn({5, cols}, DType::f64, 2), 6.0);
    Tensor g = randn({5, cols}, DType::f64, 3);
    // f64: the same formulas in the same order (σ, then the products), to rounding.
    // f32: σ is exp_approx's on the CPU in both.
    for (auto [dt, tol] : {std::pair{DType::f64, 1e-15}, std::pair{DType::f32, 1e-6}}) {
      DYNAMIC_SECTION(dtype_name(dt) << " cols " << cols) {
        GateRun fused = run_gate(fused_fn, x.to(dt), z.to(dt), g.to(dt));
        GateRun plain = run_gate(plain_fn, x.to(dt), z.to(dt), g.to(dt));
        CHECK(fused.y.dtype() == dt);
        CHECK(rel_error(fused.y.to(DType::f64), plain.y.to(DType::f64)) <= tol);
        CHECK(rel_error(fused.grad_x.to(DType::f64), plain.grad_x.to(DType::f64)) <= tol);
        CHECK(rel_error(fused.grad_z.to(DType::f64), plain.grad_z.to(DType::f64)) <= tol);
      }
    }
    // bf16: the fused op rounds each output once; the sequence rounds σ(z) to bf16
    // first, which makes σ (1 - σ) 0 where σ rounds to 1, so its grad_z is the worse
    // one. Against f64 on the same (bf16) inputs: the fused op within one bf16
    // rounding (2^-8) of each output's scale, and never further than the sequence.
    DYNAMIC_SECTION("bf16 cols " << cols) {
      const Tensor xb = x.to(DType::bf16), zb = z.to(DType::bf16), gb = g.to(DType::bf16);
      GateRun exact = run_gate(plain_fn, xb.to(DType::f64), zb.to(DType::f64), gb.to(DType::f64));
      GateRun fused = run_gate(fused_fn, xb, zb, gb);
      GateRun plain = run_gate(plain_fn, xb, zb, gb);
      CHECK(fused.y.dtype() == DType::bf16);
      for (auto [f, p, e] : {std::tuple{fused.y, plain.y, exact.y},
                             std::tuple{fused.grad_x, plain.grad_x, exact.grad_x},
                             std::tuple{fused.grad_z, plain.grad_z, exact.grad_z}}) {
        const double err_fused = rel_error(f.to(DType::f64), e), err_plain = rel_error(p.to(DType::f64), e);
        INFO("fused " << err_fused << ", sequence " << err_plain);
        CHECK(err_fused <= 1.0 / 256);
        CHECK(err_fused <= err_plain + 1e-12);
      }
    }
  }
}

TEST_CASE("sigmoid_gate: gradients match finite differences", "[ops][elementwise]") {
  Tensor x = randn({3, 33}, DType::f64, 4), z = mul_scalar(randn({3, 33}, DType::f64, 5), 3.0);
  check_gradients([](const Tensors& in) { return sigmoid_gate(in[0], in[1]); }, {x, z});
}

TEST_CASE("sigmoid_gate: only the inputs that need a gradient get one", "[ops][elementwise]") {
  Tensor x = randn({2, 7}, DType::f64, 6).set_requires_grad(), z = randn({2, 7}, DType::f64, 7);
  sigmoid_gate(x, z).backward(ones({2, 7}, DType::f64));
  CHECK(x.grad().defined());
  CHECK_FALSE(z.grad().defined());
  // grad_x = σ(z) for an upstream gradient of ones
  const std::vector<double> gx = x.grad().to_vector(), zv = z.to_vector();
  for (size_t i = 0; i < gx.size(); ++i) CHECK(gx[i] == Approx(1.0 / (1.0 + std::exp(-zv[i]))).epsilon(1e-15));
}

TEST_CASE("sigmoid_gate: shapes that differ are refused naming the op and both shapes", "[ops][elementwise]") {
  Tensor x = randn({2, 8}, DType::f32, 1), z = randn({2, 4}, DType::f32, 2);
  CHECK_THROWS_WITH(sigmoid_gate(x, z), Catch::Contains("sigmoid_gate") && Catch::Contains("[2, 8]") &&
                                            Catch::Contains("[2, 4]"));
}

// The CUDA kernels compute simt::sigmoid_gate_value / sigmoid_gate_grads per element;
// the unfused CUDA kernels compute sigmoid_d (1 / (1 + exp(-z))), then mul, and in
// backward mul's two products and sigmoid's derivative y (1 - y) times its upstream
// gradient (elementwise_cuda.cu). Written out here, they must give the same bits.
TEST_CASE("sigmoid_gate: the CUDA kernels' arithmetic gives the unfused kernels' bits (host run)",
          "[ops][elementwise][simt]") {
  auto check = [](auto tag) {
    using A = decltype(tag);
    std::vector<A> zs{A(0), A(-0.5), A(0.5), A(3), A(-3), A(17), A(-17), A(88), A(-88), A(1e-7)};
    for (int i = 0; i < 200; ++i) zs.push_back(A(-12) + A(24) * A(i) / A(199));
    for (A z : zs)
      for (A x : {A(1.25), A(-0.3), A(1e3)})
        for (A gy : {A(1), A(-2.5e-3)}) {
          const A s = A(1) / (A(1) + std::exp(-z));  // sigmoid_kernel, stored
          const A y_plain = x * s;                   // mul kernel
          const A gx_plain = gy * s;                 // mul's backward: grad a = g b
          const A gs = gy * x;                       //                 grad b = g a
          const A gz_plain = gs * (s * (A(1) - s));  // sigmoid's backward: g y (1 - y)
          A gx = 0, gz = 0;
          simt::sigmoid_gate_grads(gy, x, z, gx, gz);
          INFO("z " << z << " x " << x << " gy " << gy);
          CHECK(simt::sigmoid_gate_value(x, z) == y_plain);
          CHECK(gx == gx_plain);
          CHECK(gz == gz_plain);
        }
  };
  check(float{});
  check(double{});
}

TEST_CASE("sigmoid_gate: one launch forward and one backward, where the sequence takes five", "[ops][elementwise]") {
  Tensor x = randn({4, 16}, DType::f32, 8), z = randn({4, 16}, DType::f32, 9), g = randn({4, 16}, DType::f32, 10);
  auto count = [&](auto fn) {
    const LaunchCounts before = launch_counts();
    run_gate(fn, x, z, g);
    return (launch_counts() - before).cpu_kernels;
  };
  // sigmoid, mul; backward: two products (mul) and sigmoid's derivative
  CHECK(count([](const Tensor& a, const Tensor& b) { return mul(a, sigmoid(b)); }) == 5);
  CHECK(count([](const Tensor& a, const Tensor& b) { return sigmoid_gate(a, b); }) == 2);
}

TEST_CASE("sigmoid_gate: CUDA matches CPU", "[ops][elementwise][cuda]") {
  using namespace moetrain::testing;
  if (!gpu_available()) return;
  for (DType dt : {DType::f32, DType::bf16, DType::f64})
    for (int64_t cols : {1, 31, 33, 4099}) {
      DYNAMIC_SECTION(dtype_name(dt) << " cols " << cols) {
        Tensor x = randn({9, cols}, DType::f64, 11), z = mul_scalar(randn({9, cols}, DType::f64, 12), 4.0);
        check_cuda_matches_cpu([](const Tensors& in) { return sigmoid_gate(in[0], in[1]); }, {x, z}, {true, true}, dt,
                               tolerance_for(dt));
      }
    }
}
