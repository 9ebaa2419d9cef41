// causal_attention's max logit (QK-Clip's statistic, docs/model.md#qk-clip) against
// a direct f64 computation: every score scale·q_t·k_s of the causal positions
// s <= Tk - T + t, the max per head over b, t and s. Also the elementwise
// maximum that folds it across forwards.
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <vector>

#include "moetrain.h"
#include "ops/attention/attention_kernels.h"
#include "testing.h"

using namespace moetrain;

namespace {

// max over b, t, s <= Tk - T + t of scale Σ_d q[b,t,h,d] k[b,s,h,d], per head, in f64.
std::vector<double> max_logit_reference(const Tensor& q, const Tensor& k, double scale) {
  const int64_t B = q.size(0), T = q.size(1), Tk = k.size(1), H = q.size(2), D = q.size(3);
  const std::vector<double> vq = q.to(DType::f64).to_vector(), vk = k.to(DType::f64).to_vector();
  std::vector<double> out(static_cast<size_t>(H), -std::numeric_limits<double>::infinity());
  for (int64_t h = 0; h < H; ++h)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t s = 0; s <= Tk - T + t; ++s) {
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += vq[((b * T + t) * H + h) * D + d] * vk[((b * Tk + s) * H + h) * D + d];
          out[static_cast<size_t>(h)] = std::max(out[static_cast<size_t>(h)], dot * scale);
        }
  return out;
}

// Integer values in [-8, 8]: their products and sums are exact in f64 in any order.
Tensor small_integers(const Shape& shape, uint64_t seed) {
  std::vector<double> v = randn(shape, DType::f64, seed).to_vector();
  for (double& x : v) x = std::round(std::clamp(3.0 * x, -8.0, 8.0));
  return from_vector(v, shape, DType::f64);
}

}  // namespace

TEST_CASE("causal_attention max_logit: f64 matches the direct max over causal scores, Tk >= T",
          "[ops][attention][qk_clip]") {
  struct Case {
    int64_t B, T, Tk, H, Dk, Dv;
  };
  const std::vector<Case> cases = {
      {2, 1, 1, 3, 8, 5},   {2, 31, 31, 3, 8, 5}, {2, 64, 64, 3, 8, 5},   {1, 65, 65, 2, 16, 4},
      {2, 131, 131, 3, 8, 5}, {2, 3, 75, 3, 8, 5}, {1, 70, 75, 2, 8, 6}, {2, 1, 129, 4, 12, 3},
  };
  for (const Case& c : cases) {
    DYNAMIC_SECTION("B=" << c.B << " T=" << c.T << " Tk=" << c.Tk << " H=" << c.H) {
      Tensor q = randn({c.B, c.T, c.H, c.Dk}, DType::f64, 1), k = randn({c.B, c.Tk, c.H, c.Dk}, DType::f64, 2),
             v = randn({c.B, c.Tk, c.H, c.Dv}, DType::f64, 3);
      // The future keys get a large logit: a mask that let one through would show.
      std::vector<double> kv = k.to_vector();
      for (int64_t b = 0; b < c.B; ++b)
        for (int64_t h = 0; h < c.H; ++h)
          for (int64_t d = 0; d < c.Dk; ++d)
            kv[static_cast<size_t>(((b * c.Tk + c.Tk - 1) * c.H + h) * c.Dk + d)] *= 20;
      k = from_vector(kv, k.shape(), DType::f64);
      const double scale = 0.35;
      Tensor m;
      Tensor o = causal_attention(q, k, v, scale, &m);
      REQUIRE(m.shape() == Shape{c.H});
      REQUIRE(m.dtype() == DType::f64);
      const std::vector<double> ref = max_logit_reference(q, k, scale), got = m.to_vector();
      // The kernel's scores come from BLAS, whose dot products sum in another
      // order than the reference's: 1e-13 relative (|score| <~ 1e2, Dk <= 16 terms).
      for (size_t h = 0; h < ref.size(); ++h) CHECK(got[h] == Approx(ref[h]).epsilon(1e-13).margin(1e-13));
      // The output is the 4-argument call's, bit for bit.
      CHECK(moetrain::testing::bitwise_equal(o, causal_attention(q, k, v, scale)));
    }
  }
}

TEST_CASE("causal_attention max_logit: exact where the scores are exact (integer q, k; scale a power of 2)",
          "[ops][attention][qk_clip]") {
  // Every product and sum is an integer below 2^53 and the scale is 2^-2, so any
  // summation order gives the same score: the max must be equal, not near.
  for (auto [T, Tk] : {std::pair<int64_t, int64_t>{37, 37}, {5, 80}, {100, 100}}) {
    DYNAMIC_SECTION("T=" << T << " Tk=" << Tk) {
      Tensor q = small_integers({2, T, 3, 7}, 4), k = small_integers({2, Tk, 3, 7}, 5);
      Tensor v = randn({2, Tk, 3, 4}, DType::f64, 6);
      Tensor m;
      causal_attention(q, k, v, 0.25, &m);
      const std::vector<double> ref = max_logit_reference(q, k, 0.25), got = m.to_vector();
      for (size_t h = 0; h < ref.size(); ++h) CHECK(got[h] == ref[h]);
    }
  }
}

TEST_CASE("causal_attention max_logit: f32 dtype, no gradient, -inf without queries", "[ops][attention][qk_clip]") {
  Tensor q = randn({2, 9, 2, 4}, DType::f32, 7), k = randn({2, 9, 2, 4}, DType::f32, 8),
         v = randn({2, 9, 2, 4}, DType::f32, 9);
  q.set_requires_grad(true);
  k.set_requires_grad(true);
  Tensor m;
  Tensor o = causal_attention(q, k, v, 0.5, &m);
  CHECK(o.requires_grad());
  CHECK(m.dtype() == DType::f32);
  CHECK_FALSE(m.requires_grad());
  const std::vector<double> ref = max_logit_reference(q.detach(), k.detach(), 0.5), got = m.to_vector();
  for (size_t h = 0; h < ref.size(); ++h) CHECK(got[h] == Approx(ref[h]).epsilon(1e-6));

  // No query rows (T = 0): no logit, -inf for every head.
  Tensor none;
  causal_attention(randn({1, 0, 3, 4}, DType::f64, 1), randn({1, 5, 3, 4}, DType::f64, 2),
                   randn({1, 5, 3, 4}, DType::f64, 3), 1.0, &none);
  REQUIRE(none.shape() == Shape{3});
  for (double x : none.to_vector()) CHECK(x == -std::numeric_limits<double>::infinity());
}

TEST_CASE("maximum: elementwise with broadcasting, NaN propagates, not recorded", "[ops][elementwise][qk_clip]") {
  const double nan = std::nan("");
  Tensor a = from_vector({1, -2, nan, 5, -INFINITY, 3}, Shape{6}, DType::f64);
  Tensor b = from_vector({0, -1, 4, nan, -INFINITY, 3}, Shape{6}, DType::f64);
  std::vector<double> m = maximum(a, b).to_vector();
  CHECK(m[0] == 1);
  CHECK(m[1] == -1);
  CHECK(std::isnan(m[2]));
  CHECK(std::isnan(m[3]));
  CHECK(m[4] == -INFINITY);
  CHECK(m[5] == 3);
  Tensor row = from_vector({0.5, 2.5}, Shape{2});
  Tensor grid = from_vector({1, 1, 3, 3}, Shape{2, 2});
  CHECK(maximum(grid, row).to_vector() == std::vector<double>{1, 2.5, 3, 3});
  Tensor g = randn({3}, DType::f64, 1);
  g.set_requires_grad(true);
  CHECK_FALSE(maximum(g, g).requires_grad());
}

// The CUDA kernels' row max (scalar and tensor cores) against the CPU kernel's on
// the same (for bf16: bf16-rounded) values, with cached keys (Tk > T) included.
TEST_CASE("causal_attention max_logit: CUDA matches CPU", "[ops][attention][qk_clip][cuda]") {
  using namespace moetrain::testing;
  if (!gpu_available()) return;
  struct Case {
    int64_t T, Tk, Dk, Dv;
  };
  const std::vector<Case> cases = {{1, 1, 32, 32}, {17, 17, 64, 64}, {129, 129, 128, 128},
                                   {33, 33, 96, 48}, {17, 50, 64, 64}, {1, 129, 128, 128}, {40, 40, 192, 128}};
  struct Variant {
    DType dt;
    bool tensor_cores;
  };
  for (Variant var : {Variant{DType::f32, false}, Variant{DType::bf16, true}, Variant{DType::bf16, false},
                      Variant{DType::f64, false}})
    for (const Case& c : cases) {
      DYNAMIC_SECTION(fmt::format("{}{} T={} Tk={} Dk={} Dv={}", var.dt, var.tensor_cores ? " (tensor cores)" : "",
                                  c.T, c.Tk, c.Dk, c.Dv)) {
        cuda::set_attention_tensor_cores(var.tensor_cores);
        const int64_t B = 2, H = 3;
        Tensor q = randn({B, c.T, H, c.Dk}, DType::f64, 1).to(var.dt);
        Tensor k = randn({B, c.Tk, H, c.Dk}, DType::f64, 2).to(var.dt);
        Tensor v = randn({B, c.Tk, H, c.Dv}, DType::f64, 3).to(var.dt);
        const double scale = 1.5 / std::sqrt(static_cast<double>(c.Dk));
        Tensor m;
        causal_attention(q.to(kCuda), k.to(kCuda), v.to(kCuda), scale, &m);
        cuda::set_attention_tensor_cores(true);
        CHECK(m.is_cuda());
        CHECK(m.dtype() == (var.dt == DType::bf16 ? DType::f32 : var.dt));
        const std::vector<double> ref = max_logit_reference(q, k, scale), got = m.to(kCpu).to_vector();
        // f32 sums of exact bf16 (or f32) products: f32 rounding; f64: 1e-13.
        const double tol = var.dt == DType::f64 ? 1e-13 : 1e-5;
        for (size_t h = 0; h < ref.size(); ++h) CHECK(got[h] == Approx(ref[h]).epsilon(tol).margin(tol));
      }
    }
}
