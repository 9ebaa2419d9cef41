#include <catch2/catch.hpp>

#include <cmath>

#include "backend/cpu/isa.h"
#include "backend/cpu/parallel.h"
#include "moetrain.h"
#include "testing.h"
#include "ops/cuda_vs_cpu.h"

using namespace moetrain;
using moetrain::testing::check_gradients;

TEST_CASE("softmax: forward matches a plain loop, large logits stay finite", "[ops][softmax]") {
  Tensor x = randn({3, 37}, DType::f64, 1);
  std::vector<double> vx = x.to_vector(), y = softmax(x).to_vector(), ly = log_softmax(x).to_vector();
  for (int r = 0; r < 3; ++r) {
    double z = 0;
    for (int j = 0; j < 37; ++j) z += std::exp(vx[r * 37 + j]);
    for (int j = 0; j < 37; ++j) {
      REQUIRE(y[r * 37 + j] == Approx(std::exp(vx[r * 37 + j]) / z).epsilon(1e-12));
      REQUIRE(ly[r * 37 + j] == Approx(vx[r * 37 + j] - std::log(z)).epsilon(1e-12));
    }
  }
  std::vector<double> big = softmax(from_vector({1000, 1000, -1000}, {3}, DType::f32)).to_vector();
  CHECK(big[0] == Approx(0.5));
  CHECK(big[2] == 0.0);
}

TEST_CASE("softmax: gradients match finite differences", "[ops][softmax]") {
  Tensor x = randn({2, 3, 33}, DType::f64, 2);
  check_gradients([](const Tensors& in) { return softmax(in[0]); }, {x});
  check_gradients([](const Tensors& in) { return log_softmax(in[0]); }, {x});
}

TEST_CASE("cross_entropy: value matches -log softmax[target] with ignore_index", "[ops][softmax][loss]") {
  Tensor logits = randn({5, 31}, DType::f64, 3);
  Tensor targets = from_vector({3, -100, 30, 0, 7}, {5}, DType::i64);
  std::vector<double> v = logits.to_vector();
  std::vector<int> t = {3, -100, 30, 0, 7};
  double ref = 0;
  int count = 0;
  for (int r = 0; r < 5; ++r) {
    if (t[r] == -100) continue;
    double z = 0;
    for (int j = 0; j < 31; ++j) z += std::exp(v[r * 31 + j]);
    ref += std::log(z) - v[r * 31 + t[r]];
    count++;
  }
  CHECK(cross_entropy(logits, targets).item<double>() == Approx(ref / count).epsilon(1e-12));
  CHECK(cross_entropy(logits, targets, -100, Reduction::sum).item<double>() == Approx(ref).epsilon(1e-12));
  Tensor all_ignored = full({5}, -100, DType::i32);
  CHECK(cross_entropy(logits, all_ignored).item<double>() == 0.0);
}

TEST_CASE("cross_entropy: gradients match finite differences", "[ops][softmax][loss]") {
  Tensor logits = randn({2, 3, 33}, DType::f64, 4);
  Tensor targets = from_vector({1, 32, -100, 0, 17, 5}, {2, 3}, DType::i32);
  check_gradients([&](const Tensors& in) { return cross_entropy(in[0], targets); }, {logits});
  check_gradients([&](const Tensors& in) { return cross_entropy(in[0], targets, -100, Reduction::sum); }, {logits});
}

TEST_CASE("cross_entropy: f32 vocabulary rows match a double loop, value and gradient", "[ops][softmax][loss]") {
  // The vectorised row kernels (max, Σ e^{x - max} in kLanes double lanes, e^{x - lse})
  // against double arithmetic written here; widths off the vector widths.
  for (int64_t v : {33, 1000, 5003}) {
    DYNAMIC_SECTION("v=" << v) {
      const int64_t rows = 6;
      Tensor logits = mul_scalar(randn({rows, v}, DType::f32, v), 3.0);
      Tensor targets = from_vector({0.0, static_cast<double>(v - 1), -100.0, 5.0, 17.0, 1.0}, {rows}, DType::i64);
      Tensor l = logits.detach().clone();
      l.set_requires_grad(true);
      Tensor loss = cross_entropy(l, targets);
      loss.backward();
      std::vector<double> x = logits.to_vector(), g = l.grad().to_vector();
      std::vector<int64_t> t = {0, v - 1, -100, 5, 17, 1};
      double ref = 0;
      for (int64_t r = 0; r < rows; ++r) {
        if (t[static_cast<size_t>(r)] == -100) {
          for (int64_t j = 0; j < v; ++j) REQUIRE(g[static_cast<size_t>(r * v + j)] == 0.0);
          continue;
        }
        double m = -INFINITY, z = 0;
        for (int64_t j = 0; j < v; ++j) m = std::max(m, x[static_cast<size_t>(r * v + j)]);
        for (int64_t j = 0; j < v; ++j) z += std::exp(x[static_cast<size_t>(r * v + j)] - m);
        const double lse = m + std::log(z);
        ref += lse - x[static_cast<size_t>(r * v + t[static_cast<size_t>(r)])];
        for (int64_t j = 0; j < v; ++j) {
          const double p = std::exp(x[static_cast<size_t>(r * v + j)] - lse);
          const double want = (p - (j == t[static_cast<size_t>(r)] ? 1.0 : 0.0)) / 5;
          REQUIRE(g[static_cast<size_t>(r * v + j)] == Approx(want).epsilon(1e-5).margin(1e-9));
        }
      }
      CHECK(loss.item<double>() == Approx(ref / 5).epsilon(1e-6));
    }
  }
}

TEST_CASE("cross_entropy: every vector copy agrees with f64; the FMA copies give the same bits", "[ops][softmax][loss]") {
  Tensor logits = mul_scalar(randn({9, 5003}, DType::f64, 41), 3.0);
  Tensor targets = from_vector({0, 5002, -100, 5, 17, 1, 4999, 2500, 3}, {9}, DType::i64);
  auto run = [&](DType dt) {
    Tensor l = logits.to(dt).detach().set_requires_grad();
    Tensor loss = cross_entropy(l, targets);
    loss.backward();
    return std::vector<Tensor>{loss, l.grad()};
  };
  moetrain::testing::check_vector_copies(run, 1e-5);
}

TEST_CASE("cross_entropy: num_classes leaves the padding columns out of the softmax", "[ops][softmax][loss]") {
  // Logits [.., V] with V - C padding columns give the loss of the first C columns
  // alone, and gradient 0 in the padding, whatever the padding holds.
  for (DType dt : {DType::f64, DType::f32})
    for (int64_t v : {33, 5003}) {
      DYNAMIC_SECTION(fmt::format("{} v={}", dt, v)) {
        const int64_t c = v - 7;
        Tensor logits = mul_scalar(randn({2, 3, v}, DType::f64, static_cast<uint64_t>(v)), 3.0).to(dt);
        Tensor targets = from_vector({0, static_cast<double>(c - 1), -100, 5, 17, 1}, {2, 3}, DType::i64);
        Tensor padded = logits.detach().clone().set_requires_grad();
        Tensor loss = cross_entropy(padded, targets, -100, Reduction::mean, c);
        loss.backward();
        Tensor real = slice(logits, 2, 0, c).contiguous().detach().set_requires_grad();
        Tensor want = cross_entropy(real, targets);
        want.backward();
        CHECK(loss.item<double>() == want.item<double>());
        std::vector<double> g = padded.grad().to_vector(), gr = real.grad().to_vector();
        for (int64_t r = 0; r < 6; ++r)
          for (int64_t j = 0; j < v; ++j)
            REQUIRE(g[static_cast<size_t>(r * v + j)] == (j < c ? gr[static_cast<size_t>(r * c + j)] : 0.0));
        // Huge padding logits change nothing.
        Tensor spiked = concat({slice(logits, 2, 0, c), full({2, 3, 7}, 1e4, dt)}, 2);
        CHECK(cross_entropy(spiked, targets, -100, Reduction::mean, c).item<double>() == want.item<double>());
      }
    }
}

TEST_CASE("cross_entropy: num_classes gradients match finite differences", "[ops][softmax][loss]") {
  Tensor logits = randn({2, 3, 33}, DType::f64, 6);
  Tensor targets = from_vector({1, 29, -100, 0, 17, 5}, {2, 3}, DType::i32);
  check_gradients([&](const Tensors& in) { return cross_entropy(in[0], targets, -100, Reduction::mean, 30); },
                  {logits});
  check_gradients([&](const Tensors& in) { return cross_entropy(in[0], targets, -100, Reduction::sum, 30); },
                  {logits});
}

TEST_CASE("cross_entropy: the loss is f32 for f32 logits and f64 for f64", "[ops][softmax][loss]") {
  Tensor targets = from_vector({1, 2}, {2}, DType::i64);
  CHECK(cross_entropy(randn({2, 5}, DType::f32, 1), targets).dtype() == DType::f32);
  CHECK(cross_entropy(randn({2, 5}, DType::f64, 1), targets).dtype() == DType::f64);
  // bf16 logits (CPU too, tests/ops/bf16_cpu_test.cpp): an f32 loss.
  CHECK(cross_entropy(randn({2, 5}, DType::f32, 1).to(DType::bf16), targets).dtype() == DType::f32);
}

TEST_CASE("cross_entropy: bad targets are reported", "[ops][softmax][loss][errors]") {
  Tensor logits = randn({2, 10}, DType::f32, 1);
  CHECK_THROWS_WITH(cross_entropy(logits, from_vector({1, 10}, {2}, DType::i64)),
                    Catch::Contains("target 10") && Catch::Contains("[0, 10)"));
  CHECK_THROWS_WITH(cross_entropy(logits, from_vector({1, 2, 3}, {3}, DType::i64)),
                    Catch::Contains("cross_entropy") && Catch::Contains("[2, 10]"));
  CHECK_THROWS_WITH(cross_entropy(logits, from_vector({1, 2}, {2}, DType::f32)), Catch::Contains("i32 or i64"));
  // A padded vocabulary: a target in the padding, and num_classes out of range.
  CHECK_THROWS_WITH(cross_entropy(logits, from_vector({1, 8}, {2}, DType::i64), -100, Reduction::mean, 8),
                    Catch::Contains("target 8") && Catch::Contains("[0, 8)") &&
                        Catch::Contains("the 2 columns past them are a padded vocabulary's padding"));
  CHECK_THROWS_WITH(cross_entropy(logits, from_vector({1, 2}, {2}, DType::i64), -100, Reduction::mean, 11),
                    Catch::Contains("num_classes = 11") && Catch::Contains("[1, 10]") && Catch::Contains("[2, 10]"));
}

TEST_CASE("softmax and log_softmax: CUDA matches CPU", "[ops][softmax][cuda]") {
  using namespace moetrain::testing;
  if (!gpu_available()) return;
  for (DType dt : {DType::f32, DType::bf16, DType::f64})
    for (int64_t cols : {1, 31, 33, 257, 4099}) {
      DYNAMIC_SECTION(fmt::format("{} cols={}", dt, cols)) {
        Tensor x = mul_scalar(randn({2, 5, cols}, DType::f64, static_cast<uint64_t>(cols) + 1), 4.0);
        CudaCompare tol = tolerance_for(dt);
        check_cuda_matches_cpu([](const Tensors& in) { return softmax(in[0]); }, {x}, {true}, dt, tol);
        check_cuda_matches_cpu([](const Tensors& in) { return log_softmax(in[0]); }, {x}, {true}, dt, tol);
      }
    }
}

TEST_CASE("cross_entropy: CUDA matches CPU, with ignored targets", "[ops][softmax][cuda]") {
  using namespace moetrain::testing;
  if (!gpu_available()) return;
  for (DType dt : {DType::f32, DType::bf16, DType::f64})
    for (int64_t vocab : {1, 33, 257, 4099})
      for (Reduction red : {Reduction::mean, Reduction::sum})
        for (DType tdt : {DType::i64, DType::i32}) {
          DYNAMIC_SECTION(fmt::format("{} vocab={} sum={} targets {}", dt, vocab, red == Reduction::sum, tdt)) {
            int64_t rows = 37;
            Tensor logits = mul_scalar(randn({rows, vocab}, DType::f64, static_cast<uint64_t>(vocab)), 3.0);
            Generator gen(5);
            std::vector<double> t = randint({rows}, vocab, DType::i64, gen).to_vector();
            for (int64_t r = 0; r < rows; r += 4) t[static_cast<size_t>(r)] = -7;  // ignored
            Tensor targets = from_vector(t, {rows}, tdt);
            CudaCompare tol = tolerance_for(dt);
            check_cuda_matches_cpu(
                [red](const Tensors& in) { return cross_entropy(in[0], in[1], -7, red); }, {logits, targets},
                {true, false}, dt, tol);
          }
        }
}

TEST_CASE("cross_entropy: CUDA with every target ignored gives 0 and zero gradients", "[ops][softmax][cuda]") {
  using namespace moetrain::testing;
  if (!gpu_available()) return;
  Tensor logits = randn({4, 9}, DType::f32, 1).to(kCuda).detach();
  logits.set_requires_grad(true);
  Tensor targets = full({4}, -100, DType::i64).to(kCuda);
  Tensor loss = cross_entropy(logits, targets);
  CHECK(loss.to(kCpu).item<double>() == 0.0);
  loss.backward(ones({}, DType::f32).to(kCuda));
  CHECK(rel_error_nan(logits.grad(), zeros({4, 9})) == 0.0);
}
