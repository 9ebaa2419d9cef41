// gated_rms_norm with a bf16 gate under f32 x (ops/norm/norm.cpp): KDA's output gate
// projection is bf16 in mixed precision while the normed output is f32; the gate's
// cast to f32 is fused into the norm's kernels. The values and x's and the weight's
// gradients are those of casting first, bit for bit, and the gate's gradient is the
// cast's backward (one rounding to bf16). On a GPU it saves the cast's two launches.
#include <catch2/catch.hpp>

#include "core/launch_count.h"
#include "moetrain.h"
#include "testing.h"

using namespace moetrain;
using moetrain::testing::bitwise_equal;
using moetrain::testing::rel_error;

namespace {

struct GatedRun {
  Tensor y, grad_x, grad_w, grad_z;
};
template <class F>
GatedRun run_gated(F fn, const Tensor& x0, const Tensor& w0, const Tensor& z0, const Tensor& g) {
  Tensor x = x0.detach().set_requires_grad(), w = w0.detach().set_requires_grad(),
         z = z0.detach().set_requires_grad();
  Tensor y = fn(x, w, z);
  autograd::backward({y}, {g});
  return {y.detach(), x.grad(), w.grad(), z.grad()};
}

Tensor fused_gate(const Tensor& x, const Tensor& w, const Tensor& z) { return gated_rms_norm(x, w, z, 1e-6); }
Tensor cast_first(const Tensor& x, const Tensor& w, const Tensor& z) {
  return gated_rms_norm(x, w, z.to(DType::f32), 1e-6);
}

}  // namespace

TEST_CASE("gated_rms_norm: a bf16 gate under f32 x equals casting it first, bit for bit", "[ops][norm]") {
  for (int64_t n : {1, 33, 64}) {
    DYNAMIC_SECTION("n " << n) {
      Tensor x = randn({3, 5, n}, DType::f32, 1), w = randn({n}, DType::f32, 2);
      Tensor z = mul_scalar(randn({3, 5, n}, DType::f32, 3), 3.0).to(DType::bf16), g = randn({3, 5, n}, DType::f32, 4);
      GatedRun fused = run_gated(fused_gate, x, w, z, g), plain = run_gated(cast_first, x, w, z, g);
      CHECK(fused.y.dtype() == DType::f32);
      CHECK(fused.grad_z.dtype() == DType::bf16);
      CHECK(bitwise_equal(fused.y, plain.y));
      CHECK(bitwise_equal(fused.grad_x, plain.grad_x));
      CHECK(bitwise_equal(fused.grad_w, plain.grad_w));
      CHECK(bitwise_equal(fused.grad_z, plain.grad_z));
    }
  }
  // Other mixes are refused, naming the op.
  Tensor x = randn({2, 8}, DType::f32, 5), w = randn({8}, DType::f32, 6);
  CHECK_THROWS_WITH(gated_rms_norm(x, w, randn({2, 8}, DType::f64, 7)), Catch::Contains("gated_rms_norm") &&
                                                                            Catch::Contains("dtype mismatch"));
  CHECK_THROWS_WITH(gated_rms_norm(x.to(DType::f64), w.to(DType::f64), randn({2, 8}, DType::f32, 7).to(DType::bf16)),
                    Catch::Contains("gated_rms_norm") && Catch::Contains("dtype mismatch"));
}

TEST_CASE("gated_rms_norm: on a GPU, the bf16 gate's cast fused saves its two launches", "[ops][norm][cuda][launch]") {
  if (!moetrain::testing::gpu_available()) return;
  Tensor x = randn({4, 9, 64}, DType::f32, 8), w = randn({64}, DType::f32, 9);
  Tensor z = randn({4, 9, 64}, DType::f32, 10).to(DType::bf16), g = randn({4, 9, 64}, DType::f32, 11);
  auto count = [&](auto fn) {
    cuda::synchronize(0);
    const LaunchCounts before = launch_counts();
    GatedRun r = run_gated(fn, x.to(kCuda), w.to(kCuda), z.to(kCuda), g.to(kCuda));
    return std::pair{(launch_counts() - before).cuda_kernels, r};
  };
  auto [plain_n, plain] = count(cast_first);
  auto [fused_n, fused] = count(fused_gate);
  CHECK(plain_n - fused_n == 2);  // the cast forward and its gradient's cast back
  CHECK(rel_error(fused.y.to(kCpu), plain.y.to(kCpu)) == 0);
  CHECK(rel_error(fused.grad_z.to(kCpu).to(DType::f32), plain.grad_z.to(kCpu).to(DType::f32)) == 0);
  // and the CPU's values
  GatedRun cpu = run_gated(fused_gate, x, w, z, g);
  CHECK(rel_error(fused.y.to(kCpu), cpu.y) < 1e-5);
  CHECK(rel_error(fused.grad_x.to(kCpu), cpu.grad_x) < 1e-4);
  CHECK(rel_error(fused.grad_w.to(kCpu), cpu.grad_w) < 1e-4);
  CHECK(rel_error(fused.grad_z.to(kCpu).to(DType::f32), cpu.grad_z.to(DType::f32)) < 1e-2);
}
