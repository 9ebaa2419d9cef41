// matmul and linear against a plain triple loop, gradients by finite
// differences, and the error messages.
#include <catch2/catch.hpp>

#include <array>
#include <cmath>
#include <vector>

#include "moetrain.h"
#include "ops/cuda_vs_cpu.h"
#include "testing.h"

using namespace moetrain;
using moetrain::testing::check_gradients;
using moetrain::testing::GradCheckOptions;

namespace {

// C[bi] = op(A[bi]) op(B[bi or 0]) in double: A holds [batch, M, K] ([batch, K, M]
// when ta), B holds [K, N] ([N, K] when tb), per batch unless b_shared.
std::vector<double> matmul_ref(const std::vector<double>& a, const std::vector<double>& b, int64_t batch, int64_t m,
                               int64_t n, int64_t k, bool ta, bool tb, bool b_shared) {
  std::vector<double> c(static_cast<size_t>(batch * m * n), 0.0);
  for (int64_t bi = 0; bi < batch; ++bi) {
    const double* pa = a.data() + bi * m * k;
    const double* pb = b.data() + (b_shared ? 0 : bi * k * n);
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        double acc = 0;
        for (int64_t kk = 0; kk < k; ++kk) {
          double av = ta ? pa[kk * m + i] : pa[i * k + kk];
          double bv = tb ? pb[j * k + kk] : pb[kk * n + j];
          acc += av * bv;
        }
        c[static_cast<size_t>((bi * m + i) * n + j)] = acc;
      }
  }
  return c;
}

// Shape of an operand: [lead..., rows, cols] with rows/cols swapped when transposed.
Shape operand(std::vector<int64_t> lead, int64_t rows, int64_t cols, bool trans) {
  lead.push_back(trans ? cols : rows);
  lead.push_back(trans ? rows : cols);
  return Shape(lead);
}

void check_close(const std::vector<double>& got, const std::vector<double>& want, double tol) {
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    INFO("element " << i);
    REQUIRE(std::abs(got[i] - want[i]) <= tol * (1 + std::abs(want[i])));
  }
}

struct Trans {
  bool a, b;
};
const Trans kAllTrans[] = {{false, false}, {false, true}, {true, false}, {true, true}};

}  // namespace

TEST_CASE("matmul: 2D, all four transpose combinations, against a loop", "[ops][linalg]") {
  for (Trans t : kAllTrans)
    for (DType dt : {DType::f64, DType::f32})
      for (auto [m, k, n] : {std::array<int64_t, 3>{31, 33, 37}, {1, 1, 1}, {37, 31, 33}, {64, 65, 63}, {2, 9, 1}}) {
        DYNAMIC_SECTION("ta " << t.a << " tb " << t.b << " " << dtype_name(dt) << " M " << m << " K " << k << " N "
                              << n) {
          Tensor a = randn(operand({}, m, k, t.a), dt, 1), b = randn(operand({}, k, n, t.b), dt, 2);
          Tensor c = matmul(a, b, t.a, t.b);
          REQUIRE(c.shape() == Shape{m, n});
          REQUIRE(c.dtype() == dt);
          check_close(c.to_vector(), matmul_ref(a.to_vector(), b.to_vector(), 1, m, n, k, t.a, t.b, true),
                      dt == DType::f64 ? 1e-12 : 1e-5);
        }
      }
}

TEST_CASE("matmul: rank-3 a with a shared 2D b, all four transpose combinations", "[ops][linalg]") {
  const int64_t batch = 3, m = 31, k = 33, n = 37;
  for (Trans t : kAllTrans) {
    DYNAMIC_SECTION("ta " << t.a << " tb " << t.b) {
      Tensor a = randn(operand({batch}, m, k, t.a), DType::f64, 3), b = randn(operand({}, k, n, t.b), DType::f64, 4);
      Tensor c = matmul(a, b, t.a, t.b);
      REQUIRE(c.shape() == Shape{batch, m, n});
      check_close(c.to_vector(), matmul_ref(a.to_vector(), b.to_vector(), batch, m, n, k, t.a, t.b, true), 1e-12);
    }
  }
  // Rank 4 leading dims flatten the same way.
  Tensor a = randn({2, 3, 5, 7}, DType::f32, 5), b = randn({7, 4}, DType::f32, 6);
  Tensor c = matmul(a, b);
  REQUIRE(c.shape() == Shape{2, 3, 5, 4});
  check_close(c.to_vector(), matmul_ref(a.to_vector(), b.to_vector(), 6, 5, 4, 7, false, false, true), 1e-5);
}

TEST_CASE("matmul: a shared 2D a with a rank-3 b, all four transpose combinations", "[ops][linalg]") {
  const int64_t batch = 3, m = 31, k = 33, n = 37;
  for (Trans t : kAllTrans) {
    DYNAMIC_SECTION("ta " << t.a << " tb " << t.b) {
      Tensor a = randn(operand({}, m, k, t.a), DType::f64, 31), b = randn(operand({batch}, k, n, t.b), DType::f64, 32);
      Tensor c = matmul(a, b, t.a, t.b);
      REQUIRE(c.shape() == Shape{batch, m, n});
      // The loop with the roles of the shared operand swapped: C[bi] = op(A) op(B[bi]).
      std::vector<double> va = a.to_vector(), vb = b.to_vector(), vc = c.to_vector();
      for (int64_t bi = 0; bi < batch; ++bi) {
        std::vector<double> bslice(vb.begin() + bi * k * n, vb.begin() + (bi + 1) * k * n);
        std::vector<double> want = matmul_ref(va, bslice, 1, m, n, k, t.a, t.b, true);
        std::vector<double> got(vc.begin() + bi * m * n, vc.begin() + (bi + 1) * m * n);
        check_close(got, want, 1e-12);
      }
    }
  }
}

TEST_CASE("matmul: batched b, all four transpose combinations", "[ops][linalg]") {
  for (Trans t : kAllTrans)
    for (auto [m, k, n] : {std::array<int64_t, 3>{31, 33, 37}, {3, 4, 5}}) {
      DYNAMIC_SECTION("ta " << t.a << " tb " << t.b << " M " << m) {
        Tensor a = randn(operand({2, 3}, m, k, t.a), DType::f64, 7), b = randn(operand({2, 3}, k, n, t.b), DType::f64, 8);
        Tensor c = matmul(a, b, t.a, t.b);
        REQUIRE(c.shape() == Shape{2, 3, m, n});
        check_close(c.to_vector(), matmul_ref(a.to_vector(), b.to_vector(), 6, m, n, k, t.a, t.b, false), 1e-12);
      }
    }
}

TEST_CASE("matmul: large products (BLAS threads) match the loop", "[ops][linalg]") {
  // Above the size where batched products switch from one-per-thread to threaded BLAS.
  Tensor a = randn({2, 129, 130}, DType::f32, 9), b = randn({2, 130, 131}, DType::f32, 10);
  Tensor c = matmul(a, b);
  check_close(c.to_vector(), matmul_ref(a.to_vector(), b.to_vector(), 2, 129, 131, 130, false, false, false), 1e-4);
}

TEST_CASE("matmul: an empty inner dimension gives zeros", "[ops][linalg]") {
  Tensor c = matmul(zeros({3, 0}), zeros({0, 4}));
  REQUIRE(c.shape() == Shape{3, 4});
  for (double v : c.to_vector()) CHECK(v == 0.0);
  Tensor cb = matmul(zeros({2, 3, 0}), zeros({2, 0, 4}));
  REQUIRE(cb.shape() == Shape{2, 3, 4});
  for (double v : cb.to_vector()) CHECK(v == 0.0);
}

TEST_CASE("matmul: an empty inner dimension with a rank-3 a and a shared b", "[ops][linalg][empty]") {
  Tensor c = matmul(zeros({2, 3, 0}), zeros({0, 4}));
  REQUIRE(c.shape() == Shape{2, 3, 4});
  for (double v : c.to_vector()) CHECK(v == 0.0);
}

TEST_CASE("matmul: 2D gradients, all four transpose combinations", "[ops][linalg]") {
  for (Trans t : kAllTrans) {
    DYNAMIC_SECTION("ta " << t.a << " tb " << t.b) {
      Tensor a = randn(operand({}, 3, 31, t.a), DType::f64, 11), b = randn(operand({}, 31, 5, t.b), DType::f64, 12);
      check_gradients([t](const Tensors& in) { return matmul(in[0], in[1], t.a, t.b); }, {a, b});
    }
  }
}

TEST_CASE("matmul: gradients of rank-3 a with a shared 2D b", "[ops][linalg]") {
  for (Trans t : kAllTrans) {
    DYNAMIC_SECTION("ta " << t.a << " tb " << t.b) {
      Tensor a = randn(operand({2}, 3, 7, t.a), DType::f64, 13), b = randn(operand({}, 7, 5, t.b), DType::f64, 14);
      check_gradients([t](const Tensors& in) { return matmul(in[0], in[1], t.a, t.b); }, {a, b});
    }
  }
}

TEST_CASE("matmul: gradients of a shared 2D a with a rank-3 b", "[ops][linalg]") {
  for (Trans t : kAllTrans) {
    DYNAMIC_SECTION("ta " << t.a << " tb " << t.b) {
      Tensor a = randn(operand({}, 3, 7, t.a), DType::f64, 33), b = randn(operand({2}, 7, 5, t.b), DType::f64, 34);
      check_gradients([t](const Tensors& in) { return matmul(in[0], in[1], t.a, t.b); }, {a, b});
    }
  }
}

TEST_CASE("matmul: gradients with a batched b", "[ops][linalg]") {
  for (Trans t : kAllTrans) {
    DYNAMIC_SECTION("ta " << t.a << " tb " << t.b) {
      Tensor a = randn(operand({2, 2}, 3, 7, t.a), DType::f64, 15), b = randn(operand({2, 2}, 7, 4, t.b), DType::f64, 16);
      check_gradients([t](const Tensors& in) { return matmul(in[0], in[1], t.a, t.b); }, {a, b});
    }
  }
}

TEST_CASE("matmul: gradient of one operand when the other needs none", "[ops][linalg]") {
  Tensor a = randn({2, 3, 7}, DType::f64, 17), b = randn({7, 5}, DType::f64, 18);
  GradCheckOptions only_a, only_b;
  only_a.check = {true, false};
  only_b.check = {false, true};
  check_gradients([](const Tensors& in) { return matmul(in[0], in[1]); }, {a, b}, only_a);
  check_gradients([](const Tensors& in) { return matmul(in[0], in[1]); }, {a, b}, only_b);
}

TEST_CASE("linear: x W^T + bias against a loop", "[ops][linalg][linear]") {
  Tensor x = randn({2, 3, 33}, DType::f64, 19), w = randn({31, 33}, DType::f64, 20), bias = randn({31}, DType::f64, 21);
  std::vector<double> vx = x.to_vector(), vw = w.to_vector(), vb = bias.to_vector();
  std::vector<double> with = linear(x, w, bias).to_vector(), without = linear(x, w).to_vector();
  REQUIRE(linear(x, w).shape() == Shape{2, 3, 31});
  for (int64_t r = 0; r < 6; ++r)
    for (int64_t o = 0; o < 31; ++o) {
      double acc = 0;
      for (int64_t i = 0; i < 33; ++i) acc += vx[static_cast<size_t>(r * 33 + i)] * vw[static_cast<size_t>(o * 33 + i)];
      size_t at = static_cast<size_t>(r * 31 + o);
      REQUIRE(without[at] == Approx(acc).epsilon(1e-12).margin(1e-12));
      REQUIRE(with[at] == Approx(acc + vb[static_cast<size_t>(o)]).epsilon(1e-12).margin(1e-12));
    }
}

TEST_CASE("linear: gradients with and without bias, 2D input", "[ops][linalg][linear]") {
  Tensor x = randn({3, 31}, DType::f64, 22), w = randn({5, 31}, DType::f64, 23), bias = randn({5}, DType::f64, 24);
  check_gradients([](const Tensors& in) { return linear(in[0], in[1], in[2]); }, {x, w, bias});
  check_gradients([](const Tensors& in) { return linear(in[0], in[1]); }, {x, w});
}

TEST_CASE("linear: gradients with and without bias, rank-3 input", "[ops][linalg][linear]") {
  Tensor x = randn({2, 3, 7}, DType::f64, 25), w = randn({5, 7}, DType::f64, 26), bias = randn({5}, DType::f64, 27);
  check_gradients([](const Tensors& in) { return linear(in[0], in[1], in[2]); }, {x, w, bias});
  check_gradients([](const Tensors& in) { return linear(in[0], in[1]); }, {x, w});
}

TEST_CASE("matmul: a K mismatch names the op and both shapes", "[ops][linalg][errors]") {
  Tensor a = randn({3, 4}, DType::f32, 1), b = randn({5, 6}, DType::f32, 2);
  CHECK_THROWS_AS(matmul(a, b), Error);
  CHECK_THROWS_WITH(matmul(a, b), Catch::Contains("matmul") && Catch::Contains("[3, 4]") && Catch::Contains("[5, 6]"));
  CHECK_THROWS_WITH(matmul(a, b, true, false), Catch::Contains("matmul") && Catch::Contains("transposed"));
  CHECK_THROWS_WITH(matmul(randn({2, 3, 4}, DType::f32, 3), b),
                    Catch::Contains("matmul") && Catch::Contains("[2, 3, 4]") && Catch::Contains("[5, 6]"));
}

TEST_CASE("matmul: bad batch dims name the op and both shapes", "[ops][linalg][errors]") {
  Tensor a = randn({2, 3, 4}, DType::f32, 1);
  CHECK_THROWS_WITH(matmul(a, randn({3, 4, 5}, DType::f32, 2)),
                    Catch::Contains("matmul") && Catch::Contains("[2, 3, 4]") && Catch::Contains("[3, 4, 5]"));
  CHECK_THROWS_WITH(matmul(randn({2, 2, 3, 4}, DType::f32, 3), randn({4, 1, 4, 5}, DType::f32, 4)),
                    Catch::Contains("matmul") && Catch::Contains("[2, 2, 3, 4]") && Catch::Contains("[4, 1, 4, 5]"));
  CHECK_THROWS_WITH(matmul(randn({2, 3, 4}, DType::f32, 5), randn({2, 2, 4, 5}, DType::f32, 6)),
                    Catch::Contains("matmul") && Catch::Contains("[2, 3, 4]") && Catch::Contains("[2, 2, 4, 5]"));
  CHECK_THROWS_WITH(matmul(a, randn({2, 1, 4, 5}, DType::f32, 7)),
                    Catch::Contains("matmul") && Catch::Contains("[2, 3, 4]") && Catch::Contains("[2, 1, 4, 5]"));
}

TEST_CASE("matmul: bad ranks and dtypes name the op", "[ops][linalg][errors]") {
  CHECK_THROWS_WITH(matmul(randn({4}, DType::f32, 1), randn({4, 2}, DType::f32, 2)),
                    Catch::Contains("matmul") && Catch::Contains("rank"));
  CHECK_THROWS_WITH(matmul(randn({3, 4}, DType::f32, 1), randn({4, 2}, DType::f64, 2)),
                    Catch::Contains("matmul") && Catch::Contains("dtype"));
  CHECK_THROWS_WITH(matmul(randn({3, 4}, DType::bf16, 1), randn({4, 2}, DType::bf16, 2)),
                    Catch::Contains("matmul") && Catch::Contains("bf16"));
  CHECK_THROWS_WITH(matmul(zeros({3, 4}, DType::i32), zeros({4, 2}, DType::i32)), Catch::Contains("matmul"));
}

TEST_CASE("linear: bad shapes name the op", "[ops][linalg][linear][errors]") {
  Tensor x = randn({3, 8}, DType::f32, 1);
  CHECK_THROWS_WITH(linear(x, randn({4, 7}, DType::f32, 2)),
                    Catch::Contains("linear") && Catch::Contains("[3, 8]") && Catch::Contains("[4, 7]"));
  CHECK_THROWS_WITH(linear(x, randn({4, 8}, DType::f32, 3), randn({5}, DType::f32, 4)),
                    Catch::Contains("linear") && Catch::Contains("bias") && Catch::Contains("[5]"));
  CHECK_THROWS_WITH(linear(x, randn({2, 4, 8}, DType::f32, 5)), Catch::Contains("linear") && Catch::Contains("weight"));
}

TEST_CASE("matmul: CUDA (cuBLAS) matches CPU for all layouts and transposes, with gradients",
          "[ops][linalg][cuda]") {
  if (!moetrain::testing::gpu_available()) return;
  using moetrain::testing::check_cuda_matches_cpu;
  using moetrain::testing::tolerance_for;
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      DYNAMIC_SECTION("trans_a " << ta << " trans_b " << tb) {
        auto shape = [](bool t, int64_t r, int64_t c) { return t ? Shape{c, r} : Shape{r, c}; };
        auto batched = [](bool t, int64_t r, int64_t c) { return t ? Shape{3, c, r} : Shape{3, r, c}; };
        for (DType dtype : {DType::f32, DType::f64}) {
          Tensor a2 = randn(shape(ta, 33, 65), dtype, 1).set_requires_grad();
          Tensor b2 = randn(shape(tb, 65, 31), dtype, 2).set_requires_grad();
          Tensor a3 = randn(batched(ta, 33, 65), dtype, 3).set_requires_grad();
          Tensor b3 = randn(batched(tb, 65, 31), dtype, 4).set_requires_grad();
          auto fn = [ta, tb](const Tensors& in) {
            return Tensors{matmul(in[0], in[1], ta, tb), matmul(in[2], in[1], ta, tb), matmul(in[0], in[3], ta, tb),
                           matmul(in[2], in[3], ta, tb)};
          };
          check_cuda_matches_cpu(fn, {a2, b2, a3, b3}, {true, true, true, true}, dtype, tolerance_for(dtype));
          if (dtype == DType::f32)
            check_cuda_matches_cpu(fn, {a2, b2, a3, b3}, {true, true, true, true}, DType::bf16,
                                   tolerance_for(DType::bf16));
        }
      }
    }
  }
  SECTION("linear with bias") {
    Tensor x = randn({2, 17, 129}, DType::f32, 5).set_requires_grad();
    Tensor w = randn({257, 129}, DType::f32, 6).set_requires_grad(), b = randn({257}, DType::f32, 7).set_requires_grad();
    check_cuda_matches_cpu([](const Tensors& in) { return Tensors{linear(in[0], in[1], in[2])}; }, {x, w, b},
                           {true, true, true}, DType::f32, tolerance_for(DType::f32));
  }
}
