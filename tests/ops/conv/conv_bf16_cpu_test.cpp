// causal_conv1d(_silu) on bf16 tensors on the CPU (ops/conv/conv_cpu.cpp): x read as
// stored, each bf16 output row rounded once, so every output and gradient equals the
// f32 op on the same (exactly widened) values, rounded to the output's dtype: the
// bits of the whole-tensor widening the kernels replaced (ops/common/bf16_widen.h).
#include <catch2/catch.hpp>

#include <vector>

#include "backend/cpu/parallel.h"
#include "moetrain.h"
#include "ops/conv/conv.h"
#include "ops/conv/conv_silu.h"
#include "testing.h"

using namespace moetrain;

namespace {

struct ConvRun {
  Tensor y, gx, gw;
};

ConvRun conv_run(const Tensor& x0, const Tensor& w0, const Tensor& dy, bool silu) {
  Tensor x = x0.clone().detach().set_requires_grad(), w = w0.clone().detach().set_requires_grad();
  Tensor y = silu ? causal_conv1d_silu(x, w) : causal_conv1d(x, w);
  autograd::backward({y}, {dy.to(y.dtype())});
  return {y, x.grad(), w.grad()};
}

}  // namespace

TEST_CASE("causal_conv1d on bf16: the f32 op on the same values, each output rounded once; any thread count",
          "[ops][bf16]") {
  struct Case {
    bool silu;
    DType x, w;  // KDA's bf16 projection under its f32 conv weight; an all-bf16 conv
    int64_t B, T, C, W;
  };
  const int saved = cpu::num_threads();
  for (const Case& c : {Case{true, DType::bf16, DType::f32, 2, 37, 24, 4}, Case{false, DType::bf16, DType::bf16, 3, 9, 7, 3},
                        Case{true, DType::bf16, DType::bf16, 1, 70, 129, 4}, Case{false, DType::bf16, DType::bf16, 2, 5, 16, 6}}) {
    INFO("silu " << c.silu << " x " << dtype_name(c.x) << " w " << dtype_name(c.w) << " [" << c.B << ", " << c.T << ", "
                 << c.C << "] W " << c.W);
    // Values of mixed scale (some large, most small) so that summation order shows.
    Tensor x = mul(randn({c.B, c.T, c.C}, DType::f32, 1), add_scalar(mul_scalar(randn({c.B, c.T, c.C}, DType::f32, 2), 30.0), 1.0))
                   .detach()
                   .to(c.x);
    Tensor w = mul(randn({c.C, c.W}, DType::f32, 3), add_scalar(mul_scalar(randn({c.C, c.W}, DType::f32, 5), 300.0), 1.0))
                   .detach()
                   .to(c.w);
    Tensor dy = mul(randn({c.B, c.T, c.C}, DType::f32, 4), add_scalar(mul_scalar(randn({c.B, c.T, c.C}, DType::f32, 6), 300.0), 1.0))
                    .detach();
    if (c.w == DType::bf16) dy = dy.to(DType::bf16).to(DType::f32);  // y (and dy) are bf16 there
    // The reference: the f32 kernels on the widened values, then rounded.
    const ConvRun ref = conv_run(x.to(DType::f32), w.to(DType::f32), dy, c.silu);
    for (int threads : {1, 2}) {
      cpu::set_num_threads(threads);
      const ConvRun got = conv_run(x, w, dy, c.silu);
      REQUIRE(got.y.dtype() == c.w);
      CHECK(testing::bitwise_equal(got.y, ref.y.to(c.w)));
      CHECK(testing::bitwise_equal(got.gx, ref.gx.to(c.x)));
      CHECK(testing::bitwise_equal(got.gw, ref.gw.to(c.w)));
    }
  }
  cpu::set_num_threads(saved);
}

TEST_CASE("causal_conv1d on bf16: the taps are summed in the f32 kernel's order (a cancelling pair shows it)",
          "[ops][bf16]") {
  // Taps {2^20, -2^20, r} on inputs and gradients constant in time: each interior
  // output is (2^20 v - 2^20 v) + r v in the kernels' order, exactly r v; another order
  // loses r v's low bits to the large partial sum, visible after the bf16 rounding.
  const int64_t B = 1, T = 8, C = 16, W = 3;
  std::vector<float> xv(static_cast<size_t>(B * T * C)), wv(static_cast<size_t>(C * W)), gv(xv.size());
  const std::vector<double> r = randn({C}, DType::f64, 7).to_vector(), v = randn({C}, DType::f64, 8).to_vector();
  for (int64_t c = 0; c < C; ++c) {
    wv[c * W + 0] = 1048576.0f, wv[c * W + 1] = -1048576.0f, wv[c * W + 2] = static_cast<float>(r[c]);
    for (int64_t t = 0; t < T; ++t) xv[t * C + c] = gv[t * C + c] = static_cast<float>(v[c]) * 1.37f;
  }
  Tensor x = from_span<float>(xv, {B, T, C}).to(DType::bf16), w = from_span<float>(wv, {C, W}).to(DType::bf16);
  Tensor dy = from_span<float>(gv, {B, T, C}).to(DType::bf16).to(DType::f32);
  const ConvRun ref = conv_run(x.to(DType::f32), w.to(DType::f32), dy, false);
  const ConvRun got = conv_run(x, w, dy, false);
  CHECK(testing::bitwise_equal(got.y, ref.y.to(DType::bf16)));
  CHECK(testing::bitwise_equal(got.gx, ref.gx.to(DType::bf16)));
  CHECK(testing::bitwise_equal(got.gw, ref.gw.to(DType::bf16)));
}
