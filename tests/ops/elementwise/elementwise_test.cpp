#include <catch2/catch.hpp>

#include <cmath>

#include "backend/cpu/parallel.h"
#include "backend/cpu/isa.h"
#include "moetrain.h"
#include "ops/cuda_vs_cpu.h"
#include "testing.h"

using namespace moetrain;
using moetrain::testing::check_gradients;
using moetrain::testing::max_abs_diff;

namespace {
// Plain-loop references, independent of the kernels.
double gelu_ref(double x) { return 0.5 * x * (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x))); }
double sigmoid_ref(double x) { return 1 / (1 + std::exp(-x)); }
}  // namespace

TEST_CASE("elementwise: unary forwards match plain formulas", "[ops][elementwise]") {
  Tensor x = randn({5, 33}, DType::f64, 3);
  std::vector<double> v = x.to_vector();
  struct Case {
    const char* name;
    Tensor (*op)(const Tensor&);
    double (*ref)(double);
  };
  std::vector<Case> cases = {
      {"exp", moetrain::exp, [](double a) { return std::exp(a); }},
      {"tanh", moetrain::tanh, [](double a) { return std::tanh(a); }},
      {"sigmoid", moetrain::sigmoid, sigmoid_ref},
      {"silu", moetrain::silu, [](double a) { return a * sigmoid_ref(a); }},
      {"softplus", moetrain::softplus, [](double a) { return std::log(1 + std::exp(a)); }},
      {"gelu_tanh", moetrain::gelu_tanh, gelu_ref},
      {"relu", moetrain::relu, [](double a) { return a > 0 ? a : 0.0; }},
      {"square", moetrain::square, [](double a) { return a * a; }},
      {"neg", moetrain::neg, [](double a) { return -a; }},
  };
  for (const Case& c : cases) {
    DYNAMIC_SECTION(c.name) {
      std::vector<double> y = c.op(x).to_vector();
      for (size_t i = 0; i < v.size(); ++i) REQUIRE(y[i] == Approx(c.ref(v[i])).epsilon(1e-14).margin(1e-300));
    }
  }
}

TEST_CASE("elementwise: softplus does not overflow", "[ops][elementwise]") {
  Tensor x = from_vector({-1000, -30, 0, 30, 1000}, {5}, DType::f32);
  std::vector<double> y = softplus(x).to_vector();
  CHECK(y[0] == 0.0);
  CHECK(y[2] == Approx(std::log(2.0)));
  CHECK(y[4] == 1000.0);
}

TEST_CASE("elementwise: unary gradients match finite differences", "[ops][elementwise]") {
  Tensor x = randn({3, 37}, DType::f64, 11);
  Tensor pos = add_scalar(mul(x, x), 0.5);  // log, sqrt: keep the domain positive
  check_gradients([](const Tensors& in) { return moetrain::exp(in[0]); }, {x});
  check_gradients([](const Tensors& in) { return moetrain::tanh(in[0]); }, {x});
  check_gradients([](const Tensors& in) { return sigmoid(in[0]); }, {x});
  check_gradients([](const Tensors& in) { return silu(in[0]); }, {x});
  check_gradients([](const Tensors& in) { return softplus(in[0]); }, {x});
  check_gradients([](const Tensors& in) { return gelu_tanh(in[0]); }, {x});
  check_gradients([](const Tensors& in) { return square(in[0]); }, {x});
  check_gradients([](const Tensors& in) { return neg(in[0]); }, {x});
  check_gradients([](const Tensors& in) { return moetrain::log(in[0]); }, {pos});
  check_gradients([](const Tensors& in) { return moetrain::sqrt(in[0]); }, {pos});
  check_gradients([](const Tensors& in) { return pow_scalar(in[0], 1.7); }, {pos});
  check_gradients([](const Tensors& in) { return add_scalar(mul_scalar(in[0], -2.5), 3.0); }, {x});
}

TEST_CASE("elementwise: relu gradient away from the kink", "[ops][elementwise]") {
  Tensor x = randn({31}, DType::f64, 5);
  Tensor shifted = add(x, mul_scalar(sigmoid(x), 0.0));  // same values
  std::vector<double> v = shifted.to_vector();
  for (double& a : v) a = a >= 0 ? a + 0.1 : a - 0.1;
  check_gradients([](const Tensors& in) { return relu(in[0]); }, {from_vector(v, {31}, DType::f64)});
}

TEST_CASE("elementwise: broadcasting forward matches a loop", "[ops][elementwise][broadcast]") {
  Tensor a = randn({4, 1, 33}, DType::f64, 1);
  Tensor b = randn({5, 1}, DType::f64, 2);
  Tensor c = add(a, b);
  REQUIRE(c.shape() == Shape{4, 5, 33});
  std::vector<double> va = a.to_vector(), vb = b.to_vector(), vc = c.to_vector();
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 5; ++j)
      for (int k = 0; k < 33; ++k) REQUIRE(vc[(i * 5 + j) * 33 + k] == va[i * 33 + k] + vb[j]);
  Tensor d = div(a, b);
  std::vector<double> vd = d.to_vector();
  CHECK(vd[(3 * 5 + 4) * 33 + 32] == va[3 * 33 + 32] / vb[4]);
}

TEST_CASE("elementwise: binary gradients with broadcasting", "[ops][elementwise][broadcast]") {
  Tensor a = randn({3, 1, 31}, DType::f64, 1);
  Tensor b = randn({4, 31}, DType::f64, 2);
  Tensor bias = randn({31}, DType::f64, 3);
  Tensor s = randn({1}, DType::f64, 4);
  Tensor away = add_scalar(square(randn({4, 31}, DType::f64, 5)), 0.5);
  check_gradients([](const Tensors& in) { return add(in[0], in[1]); }, {a, b});
  check_gradients([](const Tensors& in) { return sub(in[0], in[1]); }, {a, b});
  check_gradients([](const Tensors& in) { return mul(in[0], in[1]); }, {a, b});
  check_gradients([](const Tensors& in) { return div(in[0], in[1]); }, {a, away});
  check_gradients([](const Tensors& in) { return mul(in[0], in[1]); }, {b, bias});
  check_gradients([](const Tensors& in) { return mul(in[0], in[1]); }, {s, a});
  check_gradients([](const Tensors& in) { return broadcast_to(in[0], {2, 4, 31}); }, {b});
  check_gradients([](const Tensors& in) { return sum_to(in[0], {4, 1}); }, {b});
}

TEST_CASE("elementwise: sum_to reduces leading and inner broadcast dims", "[ops][elementwise][broadcast]") {
  Tensor t = randn({3, 4, 5}, DType::f64, 9);
  std::vector<double> v = t.to_vector(), s = sum_to(t, {4, 1}).to_vector();
  for (int j = 0; j < 4; ++j) {
    double ref = 0;
    for (int i = 0; i < 3; ++i)
      for (int k = 0; k < 5; ++k) ref += v[(i * 4 + j) * 5 + k];
    CHECK(s[j] == Approx(ref).epsilon(1e-14));
  }
}

TEST_CASE("elementwise: a bias row added to every row, and its sum_to, equal plain loops bit for bit (f32)",
          "[ops][elementwise][broadcast]") {
  // The contiguous-row path of the broadcast loop and sum_to's trailing-dims path
  // (vectorised copies) against loops written here: + is exact per element, and the
  // column sums add the rows in order in double, as the kernels promise.
  for (int64_t n : {1, 31, 33, 257, 1027}) {
    DYNAMIC_SECTION("n=" << n) {
      Tensor x = randn({3, 7, n}, DType::f32, n), bias = randn({n}, DType::f32, n + 1);
      std::vector<double> vx = x.to_vector(), vb = bias.to_vector();  // f32 values, exact in double
      std::vector<double> sum = add(x, bias).to_vector(), diff = sub(bias, x).to_vector(),
                          prod = mul(x, bias).to_vector();
      for (int64_t r = 0; r < 21; ++r)
        for (int64_t j = 0; j < n; ++j) {
          const size_t i = static_cast<size_t>(r * n + j);
          const float a = static_cast<float>(vx[i]), c = static_cast<float>(vb[static_cast<size_t>(j)]);
          REQUIRE(sum[i] == a + c);  // float arithmetic: one rounding, as the kernel's
          REQUIRE(diff[i] == c - a);
          REQUIRE(prod[i] == a * c);
        }
      for (const Shape& to : {Shape{n}, Shape{1, n}, Shape{7, n}}) {
        std::vector<double> got = sum_to(x, to).to_vector();
        const int64_t kept = to.numel(), rows = 21 * n / kept;
        for (int64_t j = 0; j < kept; ++j) {
          double acc = 0;
          for (int64_t r = 0; r < rows; ++r) acc += vx[static_cast<size_t>(r * kept + j)];
          REQUIRE(got[static_cast<size_t>(j)] == static_cast<float>(acc));
        }
      }
    }
  }
}

TEST_CASE("elementwise: sum_to and the broadcast add do not depend on the thread count", "[ops][elementwise]") {
  Tensor x = randn({9, 5, 1031}, DType::f32, 3), bias = randn({1031}, DType::f32, 4);
  int restore = cpu::num_threads();
  cpu::set_num_threads(1);
  Tensor s1 = sum_to(x, {1031}), a1 = add(x, bias), g1 = gelu_tanh(x);
  cpu::set_num_threads(2);
  Tensor s2 = sum_to(x, {1031}), a2 = add(x, bias), g2 = gelu_tanh(x);
  cpu::set_num_threads(restore);
  CHECK(moetrain::testing::bitwise_equal(s1, s2));
  CHECK(moetrain::testing::bitwise_equal(a1, a2));
  CHECK(moetrain::testing::bitwise_equal(g1, g2));
}

TEST_CASE("elementwise: every vector copy of GELU, the bias add and sum_to agrees with f64; the FMA copies give "
          "the same bits", "[ops][elementwise]") {
  // run_vector_isa's generic, AVX2 + FMA and AVX-512 copies (backend/cpu/isa.h): the same
  // expression per element, so the FMA copies agree bit for bit; sum_to's row order is fixed.
  Tensor x = mul_scalar(randn({5, 7, 1031}, DType::f64, 21), 3.0), bias = randn({1031}, DType::f64, 22);
  Tensor dy = randn({5, 7, 1031}, DType::f64, 23);
  auto run = [&](DType dt) {
    Tensor xl = x.to(dt).detach().set_requires_grad(), bl = bias.to(dt).detach().set_requires_grad();
    Tensor y = gelu_tanh(add(xl, bl));
    y.backward(dy.to(dt));
    return std::vector<Tensor>{y, xl.grad(), bl.grad()};
  };
  moetrain::testing::check_vector_copies(run, 1e-5);
}

TEST_CASE("elementwise: bad inputs name the op and the shapes", "[ops][elementwise][errors]") {
  Tensor a = randn({3, 4}, DType::f32, 1), b = randn({5}, DType::f32, 2), c = randn({3, 4}, DType::f64, 3);
  CHECK_THROWS_WITH(add(a, b), Catch::Contains("add") && Catch::Contains("[3, 4]") && Catch::Contains("[5]"));
  CHECK_THROWS_WITH(mul(a, c), Catch::Contains("mul") && Catch::Contains("dtype") && Catch::Contains("f64"));
  CHECK_THROWS_AS(exp(arange(4)), Error);
  CHECK_THROWS_WITH(sum_to(a, {5}), Catch::Contains("sum_to"));
}

TEST_CASE("elementwise: add_ refuses tensors in a graph", "[ops][elementwise][errors]") {
  Tensor w = randn({4}, DType::f32, 1);
  w.set_requires_grad(true);
  CHECK_THROWS_WITH(add_(w, ones({4})), Catch::Contains("NoGradGuard"));
  NoGradGuard guard;
  add_(w, ones({4}));
}

TEST_CASE("elementwise: f32 tanh and gelu agree with double formulas to float precision", "[ops][elementwise]") {
  std::vector<double> xs;
  for (double x = -12; x <= 12; x += 0.00731) xs.push_back(x);
  for (double x : {1e-9, -3e-5, 9.9e-5, 1.01e-4, 0.0}) xs.push_back(x);
  Tensor x = from_vector(xs, {static_cast<int64_t>(xs.size())}, DType::f32);
  std::vector<double> xf = x.to_vector(), t = moetrain::tanh(x).to_vector(), g = gelu_tanh(x).to_vector();
  for (size_t i = 0; i < xf.size(); ++i) {
    INFO("x = " << xf[i]);
    REQUIRE(std::abs(t[i] - std::tanh(xf[i])) <= 2.4e-7 * std::max(std::abs(std::tanh(xf[i])), 1e-30) + 1e-45);
    // gelu's 1 + tanh cancels for x << 0: there float keeps ~1 ulp of |x|.
    REQUIRE(std::abs(g[i] - gelu_ref(xf[i])) <= 4e-7 * std::abs(gelu_ref(xf[i])) + 1.2e-7 * std::abs(xf[i]));
  }
}

// --- CUDA vs CPU (skipped without a GPU) ---

TEST_CASE("elementwise: CUDA matches CPU, forward and gradients, f32/f64/bf16", "[ops][elementwise][cuda]") {
  if (!moetrain::testing::gpu_available()) return;
  using moetrain::testing::check_cuda_matches_cpu;
  using moetrain::testing::tolerance_for;
  struct Shapes {
    Shape a, b;
  };
  // Same shapes, broadcast rows/columns/scalars, sizes off any block boundary.
  std::vector<Shapes> shapes = {{{257}, {257}},        {{33, 31}, {31}},         {{33, 31}, {33, 1}},
                                {{2, 3, 4099}, {1}},   {{5, 1, 7}, {1, 6, 7}},   {{1}, {3, 129}}};
  for (DType dtype : {DType::f32, DType::f64}) {
    for (size_t s = 0; s < shapes.size(); ++s) {
      DYNAMIC_SECTION("dtype " << dtype_name(dtype) << " shapes " << s) {
        Tensor a = randn(shapes[s].a, dtype, 11).set_requires_grad(),
               b = add_scalar(rand(shapes[s].b, dtype, default_generator(), 0.5, 2.0), 0.0).detach().set_requires_grad();
        check_cuda_matches_cpu([](const Tensors& in) {
          return Tensors{add(in[0], in[1]), sub(in[0], in[1]), mul(in[0], in[1]), div(in[0], in[1])};
        }, {a, b}, {true, true}, dtype, tolerance_for(dtype));
      }
    }
  }
  SECTION("unary ops, scalar ops, sum_to, broadcast_to and add_") {
    Tensor x = randn({7, 4099}, DType::f32, 5).set_requires_grad();
    Tensor pos = add_scalar(rand({7, 4099}, DType::f32, default_generator(), 0.1, 3.0), 0.0).detach().set_requires_grad();
    auto unary = [](const Tensors& in) {
      const Tensor& v = in[0];
      const Tensor& p = in[1];
      return Tensors{neg(v), exp(v), log(p), sqrt(p), square(v), tanh(v), sigmoid(v), relu(v), silu(v),
                     softplus(v), gelu_tanh(v), add_scalar(v, 0.25), mul_scalar(v, -1.5), pow_scalar(p, 1.7),
                     sum_to(v, Shape{1, 4099}), sum_to(v, Shape{7, 1}), sum_to(v, Shape{1}),
                     broadcast_to(sum_to(v, Shape{7, 1}), Shape{7, 4099})};
    };
    for (DType dtype : {DType::f32, DType::bf16}) check_cuda_matches_cpu(unary, {x, pos}, {true, true}, dtype, tolerance_for(dtype));
    Tensor d = randn({1000}, DType::f32, 3), s = randn({1000}, DType::f32, 4);
    Tensor dg = d.to(kCuda);
    add_(d, s, 0.5);
    add_(dg, s.to(kCuda), 0.5);
    CHECK(moetrain::testing::max_abs_diff(dg.to(kCpu), d) < 1e-6);
  }
}
