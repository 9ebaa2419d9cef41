// matmul and linear against a plain triple loop, gradients by finite
// differences, and the error messages.
#include <catch2/catch.hpp>

#include <array>
#include <cmath>
#include <vector>

#include "backend/cuda/cublas.h"
#include "backend/cuda/cublaslt.h"
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
  CHECK_THROWS_WITH(matmul(randn({3, 4}, DType::bf16, 1), randn({4, 2}, DType::f32, 2)),
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

// linear with a bias and linear_gelu are single ops (ops/linalg/linalg.cpp); the
// compositions they replace are matmul, add and gelu_tanh, whose CPU arithmetic
// they repeat (the same GEMMs, the same bias add, gelu_tanh's formula, sum_to's
// order for the bias gradient), so on the CPU they must agree bit for bit, in
// every vector copy this CPU runs.
namespace {

Tensors run_with_grads(const std::function<Tensor(const Tensors&)>& fn, const Tensors& inputs, const Tensor& dy) {
  Tensors leaves;
  for (const Tensor& t : inputs) leaves.push_back(t.detach().clone().set_requires_grad());
  Tensor y = fn(leaves);
  y.backward(dy);
  Tensors out{y.detach()};
  for (const Tensor& l : leaves) out.push_back(l.grad());
  return out;
}

Tensor unfused_linear(const Tensors& in) { return add(matmul(in[0], in[1], false, true), in[2]); }
Tensor unfused_linear_gelu(const Tensors& in) { return gelu_tanh(unfused_linear(in)); }

}  // namespace

TEST_CASE("linear and linear_gelu: the same bits as matmul + add (+ gelu_tanh) on the CPU", "[ops][linalg][linear]") {
  struct Case {
    Shape x;
    int64_t out;
  };
  // 300 outputs cross the bias-gradient pass's 256-column blocks; 1 row; a rank-3 input.
  for (Case c : {Case{{2, 17, 33}, 300}, Case{{5, 64}, 31}, Case{{1, 7}, 3}}) {
    for (DType dt : {DType::f32, DType::f64}) {
      for (cpu::VectorIsa isa : moetrain::testing::runnable_isas()) {
        DYNAMIC_SECTION(fmt::format("{}", c.x) << " -> " << c.out << " " << dtype_name(dt) << " " << cpu::vector_isa_name(isa)) {
          cpu::cap_vector_isa_for_testing(isa);
          const int64_t in = c.x[c.x.ndim() - 1];
          // Pre-activations around the GELU's bend: values of order 1.
          Tensor x = randn(c.x, dt, 41), w = mul_scalar(randn({c.out, in}, dt, 42), 1.0 / std::sqrt(double(in)));
          Tensor b = randn({c.out}, dt, 43), dy = randn(c.x.with(-1, c.out), dt, 44);
          Tensors fused = run_with_grads([](const Tensors& i) { return linear(i[0], i[1], i[2]); }, {x, w, b}, dy);
          Tensors ref = run_with_grads(unfused_linear, {x, w, b}, dy);
          Tensors fused_gelu =
              run_with_grads([](const Tensors& i) { return linear_gelu(i[0], i[1], i[2]); }, {x, w, b}, dy);
          Tensors ref_gelu = run_with_grads(unfused_linear_gelu, {x, w, b}, dy);
          cpu::cap_vector_isa_for_testing(std::nullopt);
          for (size_t k = 0; k < fused.size(); ++k) {
            INFO("output/gradient " << k);
            CHECK(moetrain::testing::bitwise_equal(fused[k], ref[k]));
            CHECK(moetrain::testing::bitwise_equal(fused_gelu[k], ref_gelu[k]));
          }
          // And the GELU really ran: gelu_tanh(x W^T + b) by a double loop, to f32 rounding.
          std::vector<double> vx = x.to(DType::f64).to_vector(), vw = w.to(DType::f64).to_vector(),
                              vb = b.to(DType::f64).to_vector(), vy = fused_gelu[0].to(DType::f64).to_vector();
          const int64_t rows = x.numel() / in;
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t o = 0; o < c.out; ++o) {
              double acc = vb[static_cast<size_t>(o)];
              for (int64_t i = 0; i < in; ++i)
                acc += vx[static_cast<size_t>(r * in + i)] * vw[static_cast<size_t>(o * in + i)];
              const double want = 0.5 * acc * (1 + std::tanh(0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)));
              REQUIRE(std::abs(vy[static_cast<size_t>(r * c.out + o)] - want) <= (dt == DType::f64 ? 1e-12 : 1e-5));
            }
        }
      }
    }
  }
}

TEST_CASE("linear_gelu: gradients match finite differences", "[ops][linalg][linear]") {
  // Scaled so the pre-activations sit where GELU bends (|z| ~ 1-2).
  Tensor x = randn({3, 31}, DType::f64, 51), w = mul_scalar(randn({5, 31}, DType::f64, 52), 0.3),
         b = randn({5}, DType::f64, 53);
  check_gradients([](const Tensors& in) { return linear_gelu(in[0], in[1], in[2]); }, {x, w, b});
  Tensor x3 = randn({2, 3, 7}, DType::f64, 54), w3 = mul_scalar(randn({6, 7}, DType::f64, 55), 0.5),
         b3 = randn({6}, DType::f64, 56);
  check_gradients([](const Tensors& in) { return linear_gelu(in[0], in[1], in[2]); }, {x3, w3, b3});
  // One input at a time: the others need no gradient, and none is computed for them.
  for (int only = 0; only < 3; ++only) {
    GradCheckOptions opts;
    opts.check = {only == 0, only == 1, only == 2};
    check_gradients([](const Tensors& in) { return linear_gelu(in[0], in[1], in[2]); }, {x3, w3, b3}, opts);
    check_gradients([](const Tensors& in) { return linear(in[0], in[1], in[2]); }, {x3, w3, b3}, opts);
  }
}

TEST_CASE("mlp_gelu: the same bits as linear(linear_gelu(..)) and the unfused ops on the CPU", "[ops][linalg][linear]") {
  struct Case {
    Shape x;
    int64_t hidden, out;
  };
  for (Case c : {Case{{2, 9, 33}, 300, 35}, Case{{4, 16}, 64, 16}}) {
    for (DType dt : {DType::f32, DType::f64}) {
      for (cpu::VectorIsa isa : moetrain::testing::runnable_isas()) {
        DYNAMIC_SECTION(fmt::format("{}", c.x) << " " << dtype_name(dt) << " " << cpu::vector_isa_name(isa)) {
          cpu::cap_vector_isa_for_testing(isa);
          const int64_t in = c.x[c.x.ndim() - 1];
          Tensor x = randn(c.x, dt, 91), wf = mul_scalar(randn({c.hidden, in}, dt, 92), 1.0 / std::sqrt(double(in)));
          Tensor bf = randn({c.hidden}, dt, 93), wp = mul_scalar(randn({c.out, c.hidden}, dt, 94), 0.1);
          Tensor bp = randn({c.out}, dt, 95), dy = randn(c.x.with(-1, c.out), dt, 96);
          Tensors fused = run_with_grads(
              [](const Tensors& i) { return mlp_gelu(i[0], i[1], i[2], i[3], i[4]); }, {x, wf, bf, wp, bp}, dy);
          Tensors two_ops = run_with_grads(
              [](const Tensors& i) { return linear(linear_gelu(i[0], i[1], i[2]), i[3], i[4]); }, {x, wf, bf, wp, bp},
              dy);
          Tensors unfused = run_with_grads(
              [](const Tensors& i) {
                return add(matmul(gelu_tanh(unfused_linear({i[0], i[1], i[2]})), i[3], false, true), i[4]);
              },
              {x, wf, bf, wp, bp}, dy);
          cpu::cap_vector_isa_for_testing(std::nullopt);
          for (size_t k = 0; k < fused.size(); ++k) {
            INFO("output/gradient " << k);
            CHECK(moetrain::testing::bitwise_equal(fused[k], two_ops[k]));
            CHECK(moetrain::testing::bitwise_equal(fused[k], unfused[k]));
          }
        }
      }
    }
  }
}

TEST_CASE("mlp_gelu: gradients match finite differences", "[ops][linalg][linear]") {
  Tensor x = randn({2, 3, 7}, DType::f64, 101), wf = mul_scalar(randn({9, 7}, DType::f64, 102), 0.5),
         bf = randn({9}, DType::f64, 103), wp = mul_scalar(randn({5, 9}, DType::f64, 104), 0.5),
         bp = randn({5}, DType::f64, 105);
  auto fn = [](const Tensors& in) { return mlp_gelu(in[0], in[1], in[2], in[3], in[4]); };
  check_gradients(fn, {x, wf, bf, wp, bp});
  for (int only = 0; only < 5; ++only) {  // one input at a time
    GradCheckOptions opts;
    opts.check = {only == 0, only == 1, only == 2, only == 3, only == 4};
    check_gradients(fn, {x, wf, bf, wp, bp}, opts);
  }
}

TEST_CASE("mlp_gelu: bad arguments name the op and the shapes", "[ops][linalg][linear][errors]") {
  Tensor x = randn({3, 8}, DType::f32, 1), wf = randn({6, 8}, DType::f32, 2), bf = randn({6}, DType::f32, 3);
  Tensor wp = randn({4, 6}, DType::f32, 4), bp = randn({4}, DType::f32, 5);
  CHECK_THROWS_WITH(mlp_gelu(x, wf, bf, randn({4, 5}, DType::f32, 6), bp),
                    Catch::Contains("mlp_gelu") && Catch::Contains("[4, 5]") && Catch::Contains("[6, 8]"));
  CHECK_THROWS_WITH(mlp_gelu(x, wf, bf, wp, randn({5}, DType::f32, 7)),
                    Catch::Contains("mlp_gelu") && Catch::Contains("[5]") && Catch::Contains("[4, 6]"));
  CHECK_THROWS_WITH(mlp_gelu(x, wf, bf, wp, Tensor{}), Catch::Contains("mlp_gelu") && Catch::Contains("biases"));
  CHECK_THROWS_WITH(mlp_gelu(randn({3, 7}, DType::f32, 8), wf, bf, wp, bp),
                    Catch::Contains("mlp_gelu") && Catch::Contains("[3, 7]") && Catch::Contains("[6, 8]"));
  CHECK_THROWS_WITH(mlp_gelu(x, wf, bf, wp.to(DType::f64), bp), Catch::Contains("mlp_gelu") && Catch::Contains("f64"));
}

TEST_CASE("linear_gelu: bad arguments name the op and the shapes", "[ops][linalg][linear][errors]") {
  Tensor x = randn({3, 8}, DType::f32, 1), w = randn({4, 8}, DType::f32, 2);
  CHECK_THROWS_WITH(linear_gelu(x, w, Tensor{}), Catch::Contains("linear_gelu") && Catch::Contains("bias") &&
                                                      Catch::Contains("[4, 8]"));
  CHECK_THROWS_WITH(linear_gelu(x, w, randn({5}, DType::f32, 3)),
                    Catch::Contains("linear_gelu") && Catch::Contains("[5]") && Catch::Contains("[4, 8]"));
  CHECK_THROWS_WITH(linear_gelu(x, randn({4, 7}, DType::f32, 4), randn({4}, DType::f32, 5)),
                    Catch::Contains("linear_gelu") && Catch::Contains("[3, 8]") && Catch::Contains("[4, 7]"));
  CHECK_THROWS_WITH(linear_gelu(x, w, randn({4}, DType::f64, 6)),
                    Catch::Contains("linear_gelu") && Catch::Contains("f64"));
  CHECK_THROWS_WITH(linear(x, w, randn({4}, DType::f64, 6)), Catch::Contains("linear") && Catch::Contains("f64"));
}

// cuBLASLt's epilogues against the CPU twin. Tolerances, relative to the largest
// value: f32 1e-3 forward / 2e-3 backward (the GEMM's order, and the GELU epilogue's
// own tanh, which may be the GPU's approximate tanh, ~5e-4 relative, where ours is
// within a few ulp); TF32 5e-3 (10-bit mantissa operands, as the grouped GEMM's
// TF32 test); bf16 the project's 1e-2 / 2e-2.
// Shapes cuBLASLt takes (every leading dim a multiple of 16 bytes) go to the
// epilogues (counted by cuda::lt_stats) unless this cuBLASLt offers no algorithm
// for one (or its GELU is not the tanh form): then that GEMM falls back, which is
// reported (WARN) and its numbers checked like the rest, not a failure. Odd
// shapes (out = 50257, GPT-2's vocabulary) take the plain cuBLAS path; and with
// every epilogue switched off (set_lt_epilogues_enabled(0)) the whole fallback
// path is checked against the CPU on the same shapes.
TEST_CASE("linear and linear_gelu: CUDA (cuBLASLt epilogues) matches CPU in f32, TF32 and bf16",
          "[ops][linalg][linear][cuda]") {
  if (!moetrain::testing::gpu_available()) return;
  using moetrain::testing::check_cuda_matches_cpu;
  using moetrain::testing::CudaCompare;
  using E = cuda::LtEpilogue;
  if (cuda::lt_gelu_form(0) != cuda::GeluForm::tanh)
    WARN("cuBLASLt's GELU epilogue is not the tanh form on this GPU: the fused GELU GEMMs fall back (checked)");
  auto lin = [](const Tensors& in) { return Tensors{linear(in[0], in[1], in[2])}; };
  auto lin_gelu = [](const Tensors& in) { return Tensors{linear_gelu(in[0], in[1], in[2])}; };
  auto mlp = [](const Tensors& in) { return Tensors{mlp_gelu(in[0], in[1], in[2], in[3], in[4])}; };
  // GEMMs of epilogue e between two snapshots that ran or could not (both check the numbers).
  auto taken = [](const cuda::LtStats& a, const cuda::LtStats& b, E e) {
    const int i = static_cast<int>(e);
    return (b.runs[i] - a.runs[i]) + (b.unavailable[i] - a.unavailable[i]);
  };
  auto unavailable = [](const cuda::LtStats& a, const cuda::LtStats& b) {
    int64_t n = 0;
    for (int e = 0; e < 4; ++e) {
      if (b.unavailable[e] > a.unavailable[e])
        WARN("cuBLASLt took no " << cuda::lt_epilogue_name(static_cast<E>(e)) << " GEMM here ("
                                 << b.unavailable[e] - a.unavailable[e] << "): the plain path ran, numbers checked");
      n += b.unavailable[e] - a.unavailable[e];
    }
    return n;
  };
  struct Case {
    const char* name;
    DType dtype;
    bool tf32;
    CudaCompare tol;
  };
  for (Case c : {Case{"f32", DType::f32, false, {1e-3, 2e-3}}, Case{"tf32", DType::f32, true, {5e-3, 5e-3}},
                 Case{"bf16", DType::bf16, false, {1e-2, 2e-2}}}) {
    DYNAMIC_SECTION(c.name) {
      cuda::set_allow_tf32(c.tf32);
      // Aligned: rows 2 x 17 = 34 (rows need no alignment), in 128, out 256.
      Tensor x = randn({2, 17, 128}, DType::f32, 71), w = mul_scalar(randn({256, 128}, DType::f32, 72), 0.1),
             b = randn({256}, DType::f32, 73);
      // GPT-2's MLP as one op: GELU_AUX_BIAS, BIAS, BGRADB (projection), DGELU_BGRAD.
      Tensor wp = mul_scalar(randn({64, 256}, DType::f32, 77), 0.1), bp = randn({64}, DType::f32, 78);
      const cuda::LtStats before = cuda::lt_stats();
      check_cuda_matches_cpu(lin, {x, w, b}, {true, true, true}, c.dtype, c.tol);
      check_cuda_matches_cpu(lin_gelu, {x, w, b}, {true, true, true}, c.dtype, c.tol);
      const cuda::LtStats after = cuda::lt_stats();
      check_cuda_matches_cpu(mlp, {x, w, b, wp, bp}, {true, true, true, true, true}, c.dtype, c.tol);
      const cuda::LtStats after_mlp = cuda::lt_stats();
      CHECK(taken(after, after_mlp, E::gelu_aux_bias) == 1);
      CHECK(taken(after, after_mlp, E::bias) == 1);
      CHECK(taken(after, after_mlp, E::bgrad_a) == 1);
      CHECK(taken(after, after_mlp, E::dgelu_bgrad) == 1);
      CHECK(after_mlp.fallbacks - after.fallbacks == unavailable(after, after_mlp));
      CHECK(taken(before, after, E::bias) == 1);
      CHECK(taken(before, after, E::gelu_aux_bias) == 1);
      CHECK(taken(before, after, E::bgrad_a) == 2);
      CHECK(after.fallbacks - before.fallbacks == unavailable(before, after));
      // Every epilogue off: the same shapes through the plain path only.
      cuda::set_lt_epilogues_enabled(0);
      check_cuda_matches_cpu(lin, {x, w, b}, {true, true, true}, c.dtype, c.tol);
      check_cuda_matches_cpu(lin_gelu, {x, w, b}, {true, true, true}, c.dtype, c.tol);
      check_cuda_matches_cpu(mlp, {x, w, b, wp, bp}, {true, true, true, true, true}, c.dtype, c.tol);
      cuda::set_lt_epilogues_enabled(cuda::kAllLtEpilogues);
      const cuda::LtStats off = cuda::lt_stats();
      for (int e = 0; e < 4; ++e) CHECK(off.runs[e] == after_mlp.runs[e]);
      CHECK(off.disabled[int(E::bias)] - after_mlp.disabled[int(E::bias)] == 2);
      CHECK(off.disabled[int(E::gelu_aux_bias)] - after_mlp.disabled[int(E::gelu_aux_bias)] == 2);
      CHECK(off.disabled[int(E::bgrad_a)] - after_mlp.disabled[int(E::bgrad_a)] == 3);
      CHECK(off.disabled[int(E::dgelu_bgrad)] - after_mlp.disabled[int(E::dgelu_bgrad)] == 1);
      CHECK(off.fallbacks - after_mlp.fallbacks == 8);
      // Odd: out = 50257 (ldc and the bias gradient's GEMM refused), in = 33.
      Tensor xo = randn({3, 33}, DType::f32, 74), wo = mul_scalar(randn({50257, 33}, DType::f32, 75), 0.2),
             bo = randn({50257}, DType::f32, 76);
      check_cuda_matches_cpu(lin, {xo, wo, bo}, {true, true, true}, c.dtype, c.tol);
      check_cuda_matches_cpu(lin_gelu, {xo, wo, bo}, {true, true, true}, c.dtype, c.tol);
      const cuda::LtStats odd = cuda::lt_stats();
      for (int e = 0; e < 4; ++e) CHECK(odd.runs[e] == off.runs[e]);
      CHECK(odd.fallbacks == off.fallbacks + 4);  // two forwards, two weight gradients
      cuda::set_allow_tf32(false);
    }
  }
}

namespace {
// Host reference of the DGELU_BGRAD epilogue in row-major terms: C = (A B) * gelu'(aux),
// bias[j] = Σ_i C[i, j]; in double from the same (rounded) inputs.
void dgelu_bgrad_reference(const std::vector<double>& a, const std::vector<double>& b, const std::vector<double>& aux,
                           int64_t m, int64_t n, int64_t k, std::vector<double>& c, std::vector<double>& bias) {
  c.assign(static_cast<size_t>(m * n), 0.0);
  bias.assign(static_cast<size_t>(n), 0.0);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double acc = 0;
      for (int64_t p = 0; p < k; ++p) acc += a[static_cast<size_t>(i * k + p)] * b[static_cast<size_t>(p * n + j)];
      const double x = aux[static_cast<size_t>(i * n + j)], cc = 0.7978845608028654, ca = 0.044715;
      const double t = std::tanh(cc * (x + ca * x * x * x));
      const double d = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * cc * (1 + 3 * ca * x * x);
      c[static_cast<size_t>(i * n + j)] = acc * d;
      bias[static_cast<size_t>(j)] += acc * d;
    }
}
}  // namespace

TEST_CASE("cuBLASLt DGELU_BGRAD: the GELU gradient and the bias gradient against a host loop",
          "[ops][linalg][cuda]") {
  // The epilogue of mlp_gelu's backward, at the wrapper against a loop in double.
  if (!moetrain::testing::gpu_available()) return;
  REQUIRE(cuda::lt_gelu_form(0) == cuda::GeluForm::tanh);
  const int64_t m = 40, n = 64, k = 96;
  for (DType dt : {DType::f32, DType::bf16}) {
    DYNAMIC_SECTION(dtype_name(dt)) {
      Tensor a = randn({m, k}, DType::f32, 81).to(dt), b = mul_scalar(randn({k, n}, DType::f32, 82), 0.1).to(dt),
             aux = randn({m, n}, DType::f32, 83).to(dt);
      Tensor ga = a.to(kCuda), gb = b.to(kCuda), gaux = aux.to(kCuda);
      Tensor gc = empty({m, n}, dt, kCuda), gbias = empty({n}, dt, kCuda);
      cuda::LtGemm g;
      g.dtype = dt;
      g.m = m;
      g.n = n;
      g.k = k;
      g.a = ga.raw_data();
      g.lda = k;
      g.b = gb.raw_data();
      g.ldb = n;
      g.c = gc.raw_data();
      g.ldc = n;
      g.epilogue = cuda::LtEpilogue::dgelu_bgrad;
      g.bias = gbias.raw_data();
      g.aux = gaux.raw_data();
      g.ld_aux = n;
      REQUIRE(cuda::lt_refusal(g).empty());
      REQUIRE(cuda::lt_matmul(g, 0));
      std::vector<double> c, bias;
      dgelu_bgrad_reference(a.to(DType::f32).to_vector(), b.to(DType::f32).to_vector(), aux.to(DType::f32).to_vector(),
                            m, n, k, c, bias);
      const double tol = dt == DType::bf16 ? 2e-2 : 1e-3;  // as above: the epilogue's tanh
      CHECK(moetrain::testing::rel_error(gc.to(kCpu).to(DType::f64), from_vector(c, {m, n}, DType::f64)) <= tol);
      CHECK(moetrain::testing::rel_error(gbias.to(kCpu).to(DType::f64), from_vector(bias, {n}, DType::f64)) <= tol);
    }
  }
}
