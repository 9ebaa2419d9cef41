#include <algorithm>
#include <cmath>

#include <catch2/catch.hpp>

#include "moetrain.h"
#include "ops/cuda_vs_cpu.h"
#include "testing.h"

using namespace moetrain;
using moetrain::testing::check_gradients;

namespace {

// docs/model.md#attnres-read with plain loops: h[n] = Σ_m softmax_m(s)[m] V_m[n].
std::vector<double> reference_read(const Tensors& sources, const Tensor& proj, const Tensor& norm, double eps) {
  int64_t D = sources[0].size(-1), N = sources[0].numel() / D, M = static_cast<int64_t>(sources.size());
  std::vector<std::vector<double>> v;
  for (const Tensor& s : sources) v.push_back(s.to_vector());
  std::vector<double> w = proj.to_vector(), nu = norm.to_vector(), h(static_cast<size_t>(N * D), 0.0);
  for (int64_t n = 0; n < N; ++n) {
    std::vector<double> s(static_cast<size_t>(M));
    for (int64_t m = 0; m < M; ++m) {
      double ms = 0;
      for (int64_t d = 0; d < D; ++d) ms += v[m][n * D + d] * v[m][n * D + d];
      double r = 1.0 / std::sqrt(ms / D + eps);
      for (int64_t d = 0; d < D; ++d) s[m] += v[m][n * D + d] * r * nu[d] * w[d];
    }
    double mx = *std::max_element(s.begin(), s.end()), z = 0;
    for (double& x : s) z += (x = std::exp(x - mx));
    for (int64_t m = 0; m < M; ++m)
      for (int64_t d = 0; d < D; ++d) h[n * D + d] += s[m] / z * v[m][n * D + d];
  }
  return h;
}

Tensors random_sources(int m, const Shape& shape, uint64_t seed) {
  Tensors out;
  for (int i = 0; i < m; ++i) out.push_back(mul_scalar(randn(shape, DType::f64, seed + i), 1.0 + 0.25 * i));
  return out;
}

}  // namespace

TEST_CASE("attn_res: forward matches docs/model.md#attnres-read", "[ops][attnres]") {
  Tensors src = random_sources(4, {2, 5, 37}, 10);
  Tensor w = randn({37}, DType::f64, 1), nu = add_scalar(randn({37}, DType::f64, 2), 1.0);
  std::vector<double> ref = reference_read(src, w, nu, 1e-5), got = attn_res(src, w, nu, 1e-5).to_vector();
  for (size_t i = 0; i < ref.size(); ++i) REQUIRE(got[i] == Approx(ref[i]).epsilon(1e-12).margin(1e-13));
  // Zero pseudo-query (the init): a uniform average of the sources.
  Tensor zero = zeros({37}, DType::f64);
  std::vector<double> avg = attn_res(src, zero, nu).to_vector();
  std::vector<double> a = src[0].to_vector(), b = src[1].to_vector(), c = src[2].to_vector(), d = src[3].to_vector();
  for (size_t i = 0; i < avg.size(); ++i) REQUIRE(avg[i] == Approx((a[i] + b[i] + c[i] + d[i]) / 4).epsilon(1e-13));
  // Weights: rows sum to one, shape [..., M].
  Tensor alpha = attn_res_weights(src, w, nu);
  REQUIRE(alpha.shape() == Shape{2, 5, 4});
  std::vector<double> al = alpha.to_vector();
  for (int n = 0; n < 10; ++n) REQUIRE(al[n * 4] + al[n * 4 + 1] + al[n * 4 + 2] + al[n * 4 + 3] == Approx(1.0));
  // One source: the identity.
  REQUIRE(testing::max_abs_diff(attn_res({src[0]}, w, nu), src[0]) < 1e-15);
}

TEST_CASE("attn_res: gradients match finite differences", "[ops][attnres]") {
  // The read sums D = 33 products per output of size ~1: a 1e-6 step leaves ~1e-9
  // of rounding in each difference quotient, at the 1e-6 bar for small gradients;
  // a 1e-5 step has ~1e-10 of rounding and ~1e-10 of truncation error.
  testing::GradCheckOptions opts;
  opts.eps = 1e-5;
  for (int m : {1, 2, 5}) {
    Tensors src = random_sources(m, {3, 33}, 20);
    Tensors inputs = src;
    inputs.push_back(randn({33}, DType::f64, 3));
    inputs.push_back(add_scalar(randn({33}, DType::f64, 4), 1.0));
    check_gradients(
        [m](const Tensors& in) {
          Tensors s(in.begin(), in.begin() + m);
          return attn_res(s, in[static_cast<size_t>(m)], in[static_cast<size_t>(m) + 1], 1e-5);
        },
        inputs, opts);
  }
}

TEST_CASE("attn_res: a source used twice gets both gradients", "[ops][attnres]") {
  testing::GradCheckOptions opts;
  opts.eps = 1e-5;
  Tensor a = randn({4, 8}, DType::f64, 1), b = randn({4, 8}, DType::f64, 2);
  Tensor w = randn({8}, DType::f64, 3), nu = randn({8}, DType::f64, 4);
  check_gradients([](const Tensors& in) { return attn_res({in[0], in[1], in[0]}, in[2], in[3]); }, {a, b, w, nu},
                  opts);
}

TEST_CASE("attn_res: f32 agrees with f64", "[ops][attnres]") {
  Tensors src = random_sources(9, {4, 64, 96}, 30);
  Tensor w = randn({96}, DType::f64, 5), nu = randn({96}, DType::f64, 6);
  Tensor h64 = attn_res(src, w, nu);
  Tensors src32;
  for (const Tensor& s : src) src32.push_back(s.to(DType::f32));
  Tensor h32 = attn_res(src32, w.to(DType::f32), nu.to(DType::f32));
  REQUIRE(testing::max_abs_diff(h32.to(DType::f64), h64) < 1e-4);  // |h| <~ 40; f32 ulp there ~4e-6
}

TEST_CASE("attn_res: bad input is reported", "[ops][attnres][errors]") {
  Tensor a = randn({2, 8}, DType::f32, 1), b = randn({2, 7}, DType::f32, 2), w = randn({8}, DType::f32, 3);
  CHECK_THROWS_WITH(attn_res({a, b}, w, w), Catch::Contains("attn_res") && Catch::Contains("[2, 7]"));
  CHECK_THROWS_WITH(attn_res({a}, randn({7}, DType::f32, 4), w), Catch::Contains("proj") && Catch::Contains("[8]"));
  CHECK_THROWS_WITH(attn_res({}, w, w), Catch::Contains("at least one source"));
}

TEST_CASE("attn_res: CUDA matches CPU, forward and every gradient", "[ops][attnres][cuda]") {
  if (!moetrain::testing::gpu_available()) return;
  for (DType dtype : {DType::f32, DType::f64, DType::bf16}) {
    for (int64_t M : {1, 3, 13}) {
      Tensors in;
      for (int64_t m = 0; m < M; ++m) in.push_back(randn({2, 65, 257}, DType::f32, 10 + m));  // 130 tokens: 3 chunks
      in.push_back(mul_scalar(randn({257}, DType::f32, 1), 0.3));  // proj
      in.push_back(add_scalar(mul_scalar(randn({257}, DType::f32, 2), 0.1), 1.0));  // norm weight
      std::vector<bool> grad(in.size(), true);
      moetrain::testing::check_cuda_matches_cpu(
          [M](const Tensors& x) {
            Tensors sources(x.begin(), x.begin() + M);
            return Tensors{attn_res(sources, x[M], x[M + 1], 1e-6)};
          },
          in, grad, dtype, moetrain::testing::tolerance_for(dtype));
    }
  }
}
