// causal_conv1d_silu (ops/conv/conv_silu.h): KDA's short convolution with its SiLU
// fused equals the unfused silu(causal_conv1d(x, w)) in values and gradients, its
// gradients match float64 finite differences, the CUDA kernels' SiLU arithmetic
// (conv_silu_simt.h, run here on the host) gives the unfused CUDA kernels' bits, and
// it launches fewer kernels than the sequence (core/launch_count.h); with bf16 x under
// an f32 weight the cast is fused too.
#include <cmath>
#include <vector>

#include <catch2/catch.hpp>

#include "core/launch_count.h"
#include "moetrain.h"
#include "ops/conv/conv_silu.h"
#include "ops/conv/conv_silu_simt.h"
#include "ops/cuda_vs_cpu.h"
#include "testing.h"

using namespace moetrain;
using moetrain::testing::check_gradients;
using moetrain::testing::rel_error;

namespace {

struct ConvRun {
  Tensor y, grad_x, grad_w;
};
template <class F>
ConvRun run_conv(F fn, const Tensor& x0, const Tensor& w0, const Tensor& g) {
  Tensor x = x0.detach().set_requires_grad(), w = w0.detach().set_requires_grad();
  Tensor y = fn(x, w);
  autograd::backward({y}, {g});
  return {y.detach(), x.grad(), w.grad()};
}

Tensor fused_conv(const Tensor& x, const Tensor& w) { return causal_conv1d_silu(x, w); }
Tensor plain_conv(const Tensor& x, const Tensor& w) { return silu(causal_conv1d(x, w)); }

}  // namespace

TEST_CASE("causal_conv1d_silu: equals silu(causal_conv1d(x, w)) in values and gradients", "[ops][conv]") {
  // Channels and lengths off the vector width; 1 to 4 taps (KDA's conv_size is 4);
  // inputs large enough that the SiLU's both tails are reached.
  for (int64_t C : {1, 33}) {
    for (int64_t W : {1, 2, 4}) {
      Tensor x = mul_scalar(randn({2, 9, C}, DType::f64, 1), 3.0), w = randn({C, W}, DType::f64, 2);
      Tensor g = randn({2, 9, C}, DType::f64, 3);
      // f64: the same sums and formulas in the same order. f32: SiLU's σ is exp_approx's
      // in both, which the vector loops of the unfused silu may contract differently.
      for (auto [dt, tol] : {std::pair{DType::f64, 1e-15}, std::pair{DType::f32, 1e-6}}) {
        DYNAMIC_SECTION(dtype_name(dt) << " C " << C << " W " << W) {
          ConvRun fused = run_conv(fused_conv, x.to(dt), w.to(dt), g.to(dt));
          ConvRun plain = run_conv(plain_conv, x.to(dt), w.to(dt), g.to(dt));
          CHECK(fused.y.dtype() == dt);
          CHECK(rel_error(fused.y.to(DType::f64), plain.y.to(DType::f64)) <= tol);
          CHECK(rel_error(fused.grad_x.to(DType::f64), plain.grad_x.to(DType::f64)) <= tol);
          CHECK(rel_error(fused.grad_w.to(DType::f64), plain.grad_w.to(DType::f64)) <= tol);
        }
      }
    }
  }
}

TEST_CASE("causal_conv1d_silu: gradients match finite differences", "[ops][conv]") {
  Tensor x = randn({2, 7, 5}, DType::f64, 4), w = randn({5, 4}, DType::f64, 5);
  check_gradients([](const Tensors& in) { return causal_conv1d_silu(in[0], in[1]); }, {x, w});
}

TEST_CASE("causal_conv1d_silu: a weight of the wrong shape is refused naming the op", "[ops][conv]") {
  Tensor x = randn({1, 4, 3}, DType::f32, 1), w = randn({2, 4}, DType::f32, 2);
  CHECK_THROWS_WITH(causal_conv1d_silu(x, w), Catch::Contains("causal_conv1d_silu") && Catch::Contains("[2, 4]"));
}

// The CUDA kernels apply simt::conv_silu_value to the conv's sum and multiply the
// upstream gradient by simt::conv_silu_derivative of the recomputed sum; the unfused
// CUDA kernels computed (elementwise_cuda.cu) sigmoid_d(a) = 1 / (1 + exp(-a)),
// silu a sigmoid_d(a), and its backward g (s (1 + a (1 - s))). The same bits.
TEST_CASE("causal_conv1d_silu: the CUDA kernels' SiLU arithmetic gives the unfused kernels' bits (host run)",
          "[ops][conv][simt]") {
  auto check = [](auto tag) {
    using A = decltype(tag);
    std::vector<A> as{A(0), A(1e-7), A(-1e-7), A(30), A(-30), A(88), A(-88)};
    for (int i = 0; i < 400; ++i) as.push_back(A(-15) + A(30) * A(i) / A(399));
    for (A a : as)
      for (A g : {A(1), A(-0.37)}) {
        const A s = A(1) / (A(1) + std::exp(-a));
        INFO("a " << a << " g " << g);
        CHECK(simt::conv_silu_value(a) == a * s);
        CHECK(g * simt::conv_silu_derivative(a) == g * (s * (A(1) + a * (A(1) - s))));
      }
  };
  check(float{});
  check(double{});
}

TEST_CASE("causal_conv1d_silu: one launch forward and one backward on the CPU, where the sequence takes four",
          "[ops][conv][launch]") {
  Tensor x = randn({2, 8, 6}, DType::f32, 6), w = randn({6, 4}, DType::f32, 7), g = randn({2, 8, 6}, DType::f32, 8);
  auto count = [&](auto fn) {
    const LaunchCounts before = launch_counts();
    run_conv(fn, x, w, g);
    return (launch_counts() - before).cpu_kernels;
  };
  // conv, silu; backward: silu's derivative, the conv's (dx and dw in one CPU kernel;
  // on CUDA three launches either way: dx, dw's partial sums, their total)
  CHECK(count(plain_conv) == 4);
  CHECK(count(fused_conv) == 2);
}

// Mixed precision: KDA's projections are bf16, the conv weights f32. The cast of x to
// f32 is fused: the values and grad_w of the f32 conv of the widened x (exact), and
// grad_x rounded to bf16 once, as the cast's backward rounds the f32 gradient.
TEST_CASE("causal_conv1d_silu: bf16 x under an f32 weight equals the cast then the conv, bit for bit",
          "[ops][conv]") {
  Tensor xb = mul_scalar(randn({2, 11, 33}, DType::f32, 11), 2.0).to(DType::bf16), w = randn({33, 4}, DType::f32, 12);
  Tensor g = randn({2, 11, 33}, DType::f32, 13);
  ConvRun fused = run_conv(fused_conv, xb, w, g);
  ConvRun plain = run_conv([](const Tensor& x, const Tensor& wt) { return causal_conv1d_silu(x.to(DType::f32), wt); },
                           xb, w, g);
  CHECK(fused.y.dtype() == DType::f32);
  CHECK(fused.grad_x.dtype() == DType::bf16);
  CHECK(moetrain::testing::bitwise_equal(fused.y, plain.y));
  CHECK(moetrain::testing::bitwise_equal(fused.grad_x, plain.grad_x));
  CHECK(moetrain::testing::bitwise_equal(fused.grad_w, plain.grad_w));
  // Other mixes are refused, naming the op and both dtypes.
  CHECK_THROWS_WITH(causal_conv1d_silu(xb, w.to(DType::f64)), Catch::Contains("causal_conv1d_silu") &&
                                                                  Catch::Contains("dtype mismatch"));
  CHECK_THROWS_WITH(causal_conv1d(xb, w), Catch::Contains("causal_conv1d") && Catch::Contains("dtype mismatch"));
}

TEST_CASE("causal_conv1d_silu: on a GPU, the bf16 cast fused saves its two launches", "[ops][conv][cuda][launch]") {
  using namespace moetrain::testing;
  if (!gpu_available()) return;
  Tensor xb = randn({2, 37, 33}, DType::f32, 14).to(DType::bf16).to(kCuda), w = randn({33, 4}, DType::f32, 15).to(kCuda);
  Tensor g = randn({2, 37, 33}, DType::f32, 16).to(kCuda);
  auto count = [&](auto fn) {
    cuda::synchronize(0);
    const LaunchCounts before = launch_counts();
    ConvRun r = run_conv(fn, xb, w, g);
    return std::pair{(launch_counts() - before).cuda_kernels, r};
  };
  auto [plain_n, plain] =
      count([](const Tensor& x, const Tensor& wt) { return silu(causal_conv1d(x.to(DType::f32), wt)); });
  auto [fused_n, fused] = count(fused_conv);
  // cast, conv, silu; backward: silu's, conv's dx, dw's partials and total, the cast's
  CHECK(plain_n == 7);
  // conv+silu; backward: dx (in bf16), dw's partials and total
  CHECK(fused_n == 4);
  CHECK(rel_error(fused.y.to(kCpu), plain.y.to(kCpu)) < 1e-6);
  CHECK(rel_error(fused.grad_x.to(kCpu).to(DType::f32), plain.grad_x.to(kCpu).to(DType::f32)) < 1e-2);
  CHECK(rel_error(fused.grad_w.to(kCpu), plain.grad_w.to(kCpu)) < 1e-5);
}

TEST_CASE("causal_conv1d_silu: CUDA matches CPU", "[ops][conv][cuda]") {
  using namespace moetrain::testing;
  if (!gpu_available()) return;
  for (DType dt : {DType::f32, DType::bf16, DType::f64})
    for (int64_t C : {1, 33, 257}) {
      DYNAMIC_SECTION(dtype_name(dt) << " C " << C) {
        Tensor x = mul_scalar(randn({2, 37, C}, DType::f64, 9), 2.0), w = randn({C, 4}, DType::f64, 10);
        check_cuda_matches_cpu([](const Tensors& in) { return causal_conv1d_silu(in[0], in[1]); }, {x, w},
                               {true, true}, dt, tolerance_for(dt));
      }
    }
  // bf16 x under an f32 weight (the fused cast) against the same on the CPU
  Tensor xb = randn({2, 37, 33}, DType::f32, 17).to(DType::bf16), w = randn({33, 4}, DType::f32, 18);
  Tensor g = randn({2, 37, 33}, DType::f32, 19);
  ConvRun cpu_run = run_conv(fused_conv, xb, w, g);
  ConvRun gpu_run = run_conv(fused_conv, xb.to(kCuda), w.to(kCuda), g.to(kCuda));
  CHECK(rel_error(gpu_run.y.to(kCpu), cpu_run.y) < 1e-6);
  CHECK(rel_error(gpu_run.grad_x.to(kCpu).to(DType::f32), cpu_run.grad_x.to(DType::f32)) < 1e-2);
  CHECK(rel_error(gpu_run.grad_w.to(kCpu), cpu_run.grad_w) < 1e-5);
}
