// The CUDA cross-entropy bodies (ops/softmax/cross_entropy_simt.h), run on the host
// block by block (simt::HostBlock, every thread order), against the CPU op
// (ops/softmax/softmax_cpu.cpp): f32 and f64 logits, bf16 logits against the f32
// computation on the same rounded values (the CPU has no bf16 arithmetic), a
// padded vocabulary (num_classes < V). The [cuda] case runs the kernels themselves
// (skipped without a GPU).
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <vector>

#include "moetrain.h"
#include "ops/cuda_vs_cpu.h"
#include "ops/simt_orders.h"
#include "ops/softmax/cross_entropy_simt.h"
#include "testing.h"

using namespace moetrain;

namespace {

// What one call of the bodies gives: per-row lse, the loss, the gradient (as double).
template <class L>
struct BodyRun {
  std::vector<double> lse;
  L loss = 0;
  double counted = -1;
  std::vector<double> grad;
  std::vector<uint16_t> grad_bf16_bits;  // bf16 runs: the gradient's bits
};
template <class L>
bool same_bits(const BodyRun<L>& a, const BodyRun<L>& b) {
  return testing::same_bits(a.lse, b.lse) && std::memcmp(&a.loss, &b.loss, sizeof(L)) == 0 &&
         a.counted == b.counted &&
         testing::same_bits(a.grad, b.grad) && testing::same_bits(a.grad_bf16_bits, b.grad_bf16_bits);
}

template <class T>
double as_double(T x) {
  if constexpr (std::is_same_v<T, bf16>) return x.to_float();
  else return static_cast<double>(x);
}

// Runs rows, total and backward (grad_loss g) on the host as the kernels run them.
template <class T>
BodyRun<simt::acc_of_t<T>> run_bodies(const std::vector<T>& logits, const std::vector<int64_t>& targets, int64_t v,
                                      int64_t num_classes, int64_t ignore_index, double g, int threads,
                                      simt::HostOrder order, bool mean = true) {
  using L = simt::acc_of_t<T>;
  const int64_t rows = static_cast<int64_t>(targets.size());
  BodyRun<L> out;
  out.lse.assign(static_cast<size_t>(rows), -7);
  std::vector<double> row_loss(static_cast<size_t>(rows), -7);
  std::vector<T> grad(static_cast<size_t>(rows * v));
  simt::CrossEntropyArgs<T, int64_t> a;
  a.logits = logits.data();
  a.targets = targets.data();
  a.lse = out.lse.data();
  a.row_loss = row_loss.data();
  a.grad = grad.data();
  a.rows = rows;
  a.v = v;
  a.num_classes = num_classes;
  a.ignore_index = ignore_index;
  std::vector<double> sh(static_cast<size_t>(simt::cross_entropy_shared_elements(threads)));
  const simt::HostBlock blk = testing::host_block(threads, order);
  for (int64_t r = 0; r < rows; ++r) simt::cross_entropy_row(blk, a, r, sh.data());
  std::vector<double> partial(static_cast<size_t>(simt::cross_entropy_total_shared_elements(threads)));
  simt::cross_entropy_total(blk, &out.loss, &out.counted, row_loss.data(), targets.data(), rows, ignore_index, mean,
                            partial.data());
  // As the kernel: scale = grad_loss (the loss's dtype) / divisor.
  const double scale = static_cast<double>(static_cast<L>(g)) / simt::cross_entropy_divisor(out.counted, mean);
  for (int64_t r = 0; r < rows; ++r) simt::cross_entropy_backward_row(blk, a, r, scale);
  for (const T& x : grad) {
    out.grad.push_back(as_double(x));
    if constexpr (std::is_same_v<T, bf16>) out.grad_bf16_bits.push_back(x.bits);
  }
  return out;
}

struct CeCase {
  int64_t rows, v, num_classes;
};
const CeCase kCases[] = {
    {5, 1, 1}, {7, 33, 33}, {6, 257, 250}, {9, 1000, 1000}, {4, 5003, 4970}, {3, 50304, 50257},
};

std::vector<int64_t> make_targets(int64_t rows, int64_t num_classes, uint64_t seed) {
  Generator gen(seed);
  std::vector<double> t = randint({rows}, num_classes, DType::i64, gen).to_vector();
  std::vector<int64_t> out(t.begin(), t.end());
  out[0] = num_classes - 1;                   // the last class
  if (rows > 2) out[2] = -100;                // an ignored row
  return out;
}

// The CPU op's loss and logits gradient (grad_loss g): the reference.
std::pair<double, std::vector<double>> cpu_op(const Tensor& logits, const std::vector<int64_t>& targets,
                                              int64_t num_classes, double g, bool mean = true) {
  std::vector<double> t(targets.begin(), targets.end());
  Tensor l = logits.detach().clone().set_requires_grad();
  Tensor loss = cross_entropy(l, from_vector(t, {static_cast<int64_t>(t.size())}, DType::i64), -100,
                              mean ? Reduction::mean : Reduction::sum, num_classes);
  loss.backward(full({}, g, loss.dtype()));
  return {loss.item<double>(), l.grad().to_vector()};
}

double max_abs(const std::vector<double>& x) {
  double m = 0;
  for (double v : x) m = std::max(m, std::abs(v));
  return m;
}

}  // namespace

TEST_CASE("cross_entropy: the CUDA bodies, run on the host, match the CPU op in f32 and f64",
          "[ops][softmax][loss][simt]") {
  for (const CeCase& c : kCases)
    for (int threads : {1, 32, 256})
      DYNAMIC_SECTION("rows " << c.rows << " v " << c.v << " classes " << c.num_classes << " threads " << threads) {
        const Tensor x = mul_scalar(randn({c.rows, c.v}, DType::f64, static_cast<uint64_t>(c.v) + 3), 3.0);
        const std::vector<int64_t> targets = make_targets(c.rows, c.num_classes, 11);
        const double g = 0.75;
        for (bool mean : {true, false}) {  // f64, both reductions
          const std::vector<double> xv = x.to_vector();
          auto body = testing::run_in_all_orders([&](simt::HostOrder o) {
            return run_bodies<double>(xv, targets, c.v, c.num_classes, -100, g, threads, o, mean);
          });
          CHECK(body.counted == static_cast<double>(c.rows - (c.rows > 2 ? 1 : 0)));
          auto [loss, grad] = cpu_op(x, targets, c.num_classes, g, mean);
          CHECK(body.loss == Approx(loss).epsilon(1e-12).margin(1e-14));
          std::vector<double> d(grad.size());
          for (size_t i = 0; i < grad.size(); ++i) d[i] = body.grad[i] - grad[i];
          CHECK(max_abs(d) <= 1e-12 * std::max(1e-300, max_abs(grad)) + 1e-300);
        }
        {  // f32
          const Tensor x32 = x.to(DType::f32);
          const std::vector<double> wide = x32.to_vector();
          const std::vector<float> xv(wide.begin(), wide.end());
          auto body = testing::run_in_all_orders([&](simt::HostOrder o) {
            return run_bodies<float>(xv, targets, c.v, c.num_classes, -100, g, threads, o);
          });
          auto [loss, grad] = cpu_op(x32, targets, c.num_classes, g);
          CHECK(body.loss == Approx(loss).epsilon(2e-6));
          double worst = 0;
          for (size_t i = 0; i < grad.size(); ++i) worst = std::max(worst, std::abs(body.grad[i] - grad[i]));
          INFO("max |body - cpu| = " << worst << " of max |grad| = " << max_abs(grad));
          CHECK(worst <= 1e-5 * max_abs(grad));
          // Padding columns and the ignored row: exactly 0.
          for (int64_t r = 0; r < c.rows; ++r)
            for (int64_t j = 0; j < c.v; ++j)
              if (j >= c.num_classes || targets[static_cast<size_t>(r)] == -100)
                REQUIRE(body.grad[static_cast<size_t>(r * c.v + j)] == 0.0);
        }
      }
}

TEST_CASE("cross_entropy: the CUDA bodies read bf16 logits: f32 loss, the f32 gradient rounded once to bf16",
          "[ops][softmax][loss][simt]") {
  for (const CeCase& c : kCases)
    for (int threads : {32, 256})
      DYNAMIC_SECTION("rows " << c.rows << " v " << c.v << " classes " << c.num_classes << " threads " << threads) {
        const Tensor x = mul_scalar(randn({c.rows, c.v}, DType::f64, static_cast<uint64_t>(c.v) + 5), 4.0);
        const std::vector<double> rounded = x.to(DType::bf16).to(DType::f32).to_vector();  // bf16 values, widened
        std::vector<bf16> xb;
        std::vector<float> xf;
        for (double r : rounded) {
          xb.push_back(bf16::from_float(static_cast<float>(r)));
          xf.push_back(static_cast<float>(r));
          REQUIRE(static_cast<double>(xb.back().to_float()) == r);
        }
        const std::vector<int64_t> targets = make_targets(c.rows, c.num_classes, 13);
        const double g = 1.25;
        auto b16 = testing::run_in_all_orders([&](simt::HostOrder o) {
          return run_bodies<bf16>(xb, targets, c.v, c.num_classes, -100, g, threads, o);
        });
        auto f32 = run_bodies<float>(xf, targets, c.v, c.num_classes, -100, g, threads, simt::HostOrder::natural);
        // The same f32 arithmetic: lse and the f32 loss bit for bit, the gradient the
        // f32 one rounded once (round-to-nearest-even) to bf16.
        CHECK(testing::same_bits(b16.lse, f32.lse));
        CHECK(std::memcmp(&b16.loss, &f32.loss, sizeof(float)) == 0);
        size_t differ = 0;
        for (size_t i = 0; i < f32.grad.size(); ++i)
          differ += b16.grad_bf16_bits[i] != bf16::from_float(static_cast<float>(f32.grad[i])).bits;
        CHECK(differ == 0);
        // Against the CPU op on the widened logits: the loss as the f32 case, each
        // gradient element within half a bf16 ulp (<= 2^-8 of the value) of the
        // CPU's f32 gradient, plus the f32 case's difference.
        auto [loss, grad] = cpu_op(from_vector(rounded, {c.rows, c.v}, DType::f32), targets, c.num_classes, g);
        CHECK(b16.loss == Approx(loss).epsilon(2e-6));
        const double gmax = max_abs(grad);
        double worst = 0;
        for (size_t i = 0; i < grad.size(); ++i)
          worst = std::max(worst, std::abs(b16.grad[i] - grad[i]) - std::ldexp(std::abs(grad[i]), -8));
        INFO("max (|bf16 - cpu| - 2^-8 |cpu|) = " << worst << " of max |grad| = " << gmax);
        CHECK(worst <= 1e-5 * gmax);
      }
}

TEST_CASE("cross_entropy: the CUDA bodies give NaN, not an out-of-row read, for a target out of range",
          "[ops][softmax][loss][simt]") {
  // Device targets are not range-checked on the host (no wait for the GPU): a bad
  // one must poison its row's loss and gradient, not read another row's logits.
  const int64_t v = 40, classes = 33;
  const std::vector<double> wide = randn({3, v}, DType::f32, 2).to_vector();
  const std::vector<float> x(wide.begin(), wide.end());
  for (int64_t bad : {int64_t{33}, int64_t{39}, int64_t{-1}, int64_t{1000}}) {
    DYNAMIC_SECTION("target " << bad) {
      const std::vector<int64_t> targets = {4, bad, -100};
      auto r = run_bodies<float>(x, targets, v, classes, -100, 1.0, 32, simt::HostOrder::natural);
      CHECK(std::isnan(r.loss));
      for (int64_t j = 0; j < v; ++j) {
        REQUIRE(std::isnan(r.grad[static_cast<size_t>(v + j)]));  // the bad row
        REQUIRE(std::isfinite(r.grad[static_cast<size_t>(j)]));   // the others untouched
        REQUIRE(r.grad[static_cast<size_t>(2 * v + j)] == 0.0);
      }
    }
  }
}

TEST_CASE("cross_entropy: bf16 logits on CUDA: f32 loss, bf16 gradient, padding columns zero", "[ops][softmax][cuda]") {
  using namespace moetrain::testing;
  if (!gpu_available()) return;
  for (const CeCase& c : kCases)
    DYNAMIC_SECTION("rows " << c.rows << " v " << c.v << " classes " << c.num_classes) {
      const Tensor x = mul_scalar(randn({c.rows, c.v}, DType::f64, static_cast<uint64_t>(c.v) + 7), 4.0);
      const Tensor wide = x.to(DType::bf16).to(DType::f32);  // the CPU twin: the same rounded values in f32
      const std::vector<int64_t> targets = make_targets(c.rows, c.num_classes, 17);
      const std::vector<double> t(targets.begin(), targets.end());
      const double g = 0.5;
      Tensor l = x.to(DType::bf16).to(kCuda).detach().set_requires_grad();
      Tensor loss = cross_entropy(l, from_vector(t, {c.rows}, DType::i64).to(kCuda), -100, Reduction::mean,
                                  c.num_classes);
      REQUIRE(loss.dtype() == DType::f32);
      loss.backward(full({}, g, DType::f32).to(kCuda));
      REQUIRE(l.grad().dtype() == DType::bf16);
      auto [cpu_loss, cpu_grad] = cpu_op(wide, targets, c.num_classes, g);
      CHECK(loss.to(kCpu).item<double>() == Approx(cpu_loss).epsilon(1e-5));
      const std::vector<double> grad = l.grad().to(kCpu).to_vector();
      // Within one bf16 ulp (<= 2^-7 of the value): half for the rounding, the
      // rest for the GPU's expf against the host's exp.
      double worst = 0;
      for (size_t i = 0; i < grad.size(); ++i)
        worst = std::max(worst, std::abs(grad[i] - cpu_grad[i]) - std::ldexp(std::abs(cpu_grad[i]), -7));
      CHECK(worst <= 1e-5 * max_abs(cpu_grad));
      for (int64_t r = 0; r < c.rows; ++r)
        for (int64_t j = c.num_classes; j < c.v; ++j) REQUIRE(grad[static_cast<size_t>(r * c.v + j)] == 0.0);
    }
}

TEST_CASE("cross_entropy: CUDA targets are not read on the host; one out of range gives NaN, host targets an error",
          "[ops][softmax][cuda]") {
  using namespace moetrain::testing;
  if (!gpu_available()) return;
  Tensor logits = randn({3, 40}, DType::f32, 3).to(DType::bf16).to(kCuda).detach().set_requires_grad();
  Tensor loss = cross_entropy(logits, from_vector({4, 35, -100}, {3}, DType::i64).to(kCuda), -100, Reduction::mean, 33);
  CHECK(std::isnan(loss.to(kCpu).item<double>()));
  loss.backward(ones({}, DType::f32).to(kCuda));
  const std::vector<double> g = logits.grad().to(kCpu).to_vector();
  for (int64_t j = 0; j < 40; ++j) {
    CHECK(std::isnan(g[static_cast<size_t>(40 + j)]));
    CHECK(std::isfinite(g[static_cast<size_t>(j)]));
  }
  CHECK_THROWS_WITH(check_cross_entropy_targets(from_vector({4, 35, -100}, {3}, DType::i64), 33, -100, 7),
                    Catch::Contains("target 35") && Catch::Contains("[0, 33)"));
}
