// bf16 on the CPU (docs/cuda.md, "bf16 on the CPU"): every op with a bf16 CUDA path
// against its f32 twin on the same (bf16-rounded) inputs, oneDNN's bf16 matmul against
// a float64 reference, and the same bits for 1 and 2 threads.
//
// Tolerances, as max |bf16 - f32| / max |f32| over a tensor:
//  - forward 1e-2: a widened kernel computes in f32 exactly what the f32 kernel
//    computes and rounds each bf16 output once (relative 2^-9 per element); the
//    oneDNN products accumulate in f32 but round their bf16 outputs (and the
//    GELU/bias passes read f32 products), a few 2^-9 at most;
//  - backward 3e-2: the gradient flows through bf16 intermediates (each rounded).
#include <catch2/catch.hpp>
#include <cmath>
#include <functional>
#include <vector>

#include "backend/cpu/onednn.h"
#include "backend/cpu/parallel.h"
#include "moetrain.h"
#include "ops/kda/decay_gate.h"
#include "ops/moe/moe.h"
#include "ops/router/router.h"
#include "testing.h"

using namespace moetrain;

namespace {

constexpr double kBf16ForwardTol = 1e-2;
constexpr double kBf16BackwardTol = 3e-2;

// Runs fn on bf16 copies of the floating inputs and on f32 copies of the same rounded
// values (integer inputs pass through), backward on both with the same upstream
// gradient (rounded to bf16), and compares each output and each marked input's
// gradient. Checks that every floating output that the f32 run gives in f32 comes out
// bf16, except those listed in f32_outputs (statistics, losses: f32 on both).
void check_bf16_matches_f32(const std::function<Tensors(const Tensors&)>& fn, const Tensors& inputs,
                            const std::vector<bool>& grad, const std::vector<int>& f32_outputs = {},
                            double forward_tol = kBf16ForwardTol, double backward_tol = kBf16BackwardTol) {
  REQUIRE(grad.size() == inputs.size());
  Tensors lo, hi;
  for (size_t i = 0; i < inputs.size(); ++i) {
    Tensor l = is_floating(inputs[i].dtype()) ? inputs[i].to(DType::bf16).detach() : inputs[i];
    Tensor h = is_floating(inputs[i].dtype()) ? l.to(DType::f32).detach() : inputs[i];
    if (grad[i]) {
      l.set_requires_grad(true);
      h.set_requires_grad(true);
    }
    lo.push_back(l);
    hi.push_back(h);
  }
  Tensors out_lo = fn(lo), out_hi = fn(hi);
  REQUIRE(out_lo.size() == out_hi.size());
  Tensors roots_lo, grads_lo, roots_hi, grads_hi;
  for (size_t k = 0; k < out_lo.size(); ++k) {
    const bool kept_f32 = std::find(f32_outputs.begin(), f32_outputs.end(), static_cast<int>(k)) != f32_outputs.end();
    INFO(fmt::format("output {}: {} vs {}", k, describe(out_lo[k]), describe(out_hi[k])));
    if (is_floating(out_hi[k].dtype())) CHECK(out_lo[k].dtype() == (kept_f32 ? DType::f32 : DType::bf16));
    REQUIRE(out_lo[k].shape() == out_hi[k].shape());
    const double e = moetrain::testing::rel_error(out_lo[k].to(DType::f64), out_hi[k].to(DType::f64));
    INFO(fmt::format("output {} of {}: relative error {}", k, out_hi[k].shape(), e));
    CHECK(e <= forward_tol);
    if (!out_hi[k].requires_grad()) continue;
    Tensor w = randn(out_hi[k].shape(), DType::f32, 77 + k).to(DType::bf16);
    roots_lo.push_back(out_lo[k]);
    grads_lo.push_back(w.to(out_lo[k].dtype()));
    roots_hi.push_back(out_hi[k]);
    grads_hi.push_back(w.to(DType::f32));
  }
  if (roots_lo.empty()) return;
  autograd::backward(roots_lo, grads_lo);
  autograd::backward(roots_hi, grads_hi);
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!grad[i]) continue;
    Tensor gl = lo[i].grad(), gh = hi[i].grad();
    REQUIRE(gl.defined());
    REQUIRE(gh.defined());
    CHECK(gl.dtype() == DType::bf16);
    const double e = moetrain::testing::rel_error(gl.to(DType::f64), gh.to(DType::f64));
    INFO(fmt::format("gradient of input {} {}: relative error {}", i, inputs[i].shape(), e));
    CHECK(e <= backward_tol);
  }
}

void check_bf16_matches_f32(const std::function<Tensor(const Tensors&)>& fn, const Tensors& inputs,
                            const std::vector<bool>& grad) {
  check_bf16_matches_f32([&](const Tensors& in) { return Tensors{fn(in)}; }, inputs, grad);
}

Tensor rnd(const Shape& s, uint64_t seed, double scale = 1.0) { return mul_scalar(randn(s, DType::f32, seed), scale); }

// Restores the thread count a test changes.
struct ThreadsGuard {
  int saved = cpu::num_threads();
  ~ThreadsGuard() { cpu::set_num_threads(saved); }
};

}  // namespace

TEST_CASE("bf16 cpu: oneDNN's bf16 matmul against a float64 reference", "[ops][bf16]") {
  // bf16 inputs (exact in f64), f32 accumulation: error ~ k * 2^-24 * sum |a||b|; the
  // bf16 output adds a rounding of 2^-9 relative.
  struct Case {
    bool ta, tb;
    int64_t batch, m, n, k, stride_b;
  };
  for (Case c : {Case{false, false, 1, 7, 9, 13, -1}, Case{false, true, 1, 64, 96, 200, -1},
                 Case{true, false, 1, 33, 17, 65, -1}, Case{true, true, 1, 5, 130, 31, -1},
                 Case{false, false, 3, 16, 24, 40, -1}, Case{false, true, 4, 9, 11, 7, 0}}) {
    INFO(fmt::format("ta {} tb {} batch {} m {} n {} k {} b shared {}", c.ta, c.tb, c.batch, c.m, c.n, c.k,
                     c.stride_b == 0));
    const int64_t a_rows = c.ta ? c.k : c.m, a_cols = c.ta ? c.m : c.k;
    const int64_t b_rows = c.tb ? c.n : c.k, b_cols = c.tb ? c.k : c.n;
    const int64_t b_batch = c.stride_b == 0 ? 1 : c.batch;
    std::vector<double> a = rnd({c.batch, a_rows, a_cols}, 1).to(DType::bf16).to_vector();
    std::vector<double> b = rnd({b_batch, b_rows, b_cols}, 2).to(DType::bf16).to_vector();
    std::vector<bf16> a16(a.size()), b16(b.size());
    for (size_t i = 0; i < a.size(); ++i) a16[i] = bf16::from_float(static_cast<float>(a[i]));
    for (size_t i = 0; i < b.size(); ++i) b16[i] = bf16::from_float(static_cast<float>(b[i]));
    cpu::onednn::MatmulShape s;
    s.trans_a = c.ta, s.trans_b = c.tb, s.batch = c.batch, s.m = c.m, s.n = c.n, s.k = c.k;
    s.lda = a_cols, s.ldb = b_cols, s.ldc = c.n;
    s.stride_a = a_rows * a_cols, s.stride_b = c.stride_b == 0 ? 0 : b_rows * b_cols, s.stride_c = c.m * c.n;
    std::vector<float> c32(static_cast<size_t>(c.batch * c.m * c.n), -1.0f);
    std::vector<bf16> c16(c32.size());
    cpu::onednn::matmul(s, DType::bf16, a16.data(), b16.data(), DType::f32, c32.data());
    cpu::onednn::matmul(s, DType::bf16, a16.data(), b16.data(), DType::bf16, c16.data());
    double worst32 = 0, worst16 = 0;
    for (int64_t bi = 0; bi < c.batch; ++bi)
      for (int64_t i = 0; i < c.m; ++i)
        for (int64_t j = 0; j < c.n; ++j) {
          double ref = 0, mag = 0;
          for (int64_t kk = 0; kk < c.k; ++kk) {
            const double av = a[bi * a_rows * a_cols + (c.ta ? kk * a_cols + i : i * a_cols + kk)];
            const int64_t bb = c.stride_b == 0 ? 0 : bi;
            const double bv = b[bb * b_rows * b_cols + (c.tb ? j * b_cols + kk : kk * b_cols + j)];
            ref += av * bv;
            mag += std::abs(av * bv);
          }
          const size_t at = static_cast<size_t>((bi * c.m + i) * c.n + j);
          worst32 = std::max(worst32, std::abs(c32[at] - ref) / (mag + 1e-30));
          worst16 = std::max(worst16, std::abs(c16[at].to_float() - ref) / (mag + 1e-30));
        }
    INFO(fmt::format("worst error / sum|ab|: f32 out {}, bf16 out {}", worst32, worst16));
    CHECK(worst32 <= 1e-5);       // f32 accumulation: k 2^-24 with k <= 200
    CHECK(worst16 <= 2.0 / 256);  // one bf16 rounding (2^-9 of |c| <= sum|ab|), with margin
  }
  // accumulate: C += A B, in f32.
  std::vector<bf16> a16(6), b16(6);
  for (int i = 0; i < 6; ++i) a16[i] = bf16::from_float(static_cast<float>(i + 1)), b16[i] = bf16::from_float(0.5f);
  cpu::onednn::MatmulShape s;
  s.m = 2, s.n = 2, s.k = 3, s.lda = 3, s.ldb = 2, s.ldc = 2;
  std::vector<float> c = {100, 200, 300, 400};
  cpu::onednn::matmul(s, DType::bf16, a16.data(), b16.data(), DType::f32, c.data(), true);
  CHECK(c == std::vector<float>{103, 203, 307.5f, 407.5f});
}

TEST_CASE("bf16 cpu: oneDNN's primitive cache stays bounded as row counts change; evicted shapes still compute",
          "[ops][bf16]") {
  // An MoE layer's expert products get new row counts every step (the cache grew
  // without bound: k3-tiny bf16's peak memory 2.2x the ledger's after 6 steps).
  const int64_t n = 8, k = 16, rows = static_cast<int64_t>(cpu::onednn::kCachedPrimitives) + 40;
  std::vector<bf16> a(static_cast<size_t>(rows * k)), b(static_cast<size_t>(k * n));
  for (size_t i = 0; i < a.size(); ++i) a[i] = bf16::from_float(static_cast<float>(i % 7) - 3.0f);
  for (size_t i = 0; i < b.size(); ++i) b[i] = bf16::from_float(static_cast<float>(i % 5) * 0.5f);
  auto shape = [&](int64_t m) {
    cpu::onednn::MatmulShape s;
    s.m = m, s.n = n, s.k = k, s.lda = k, s.ldb = n, s.ldc = n;
    return s;
  };
  auto product = [&](int64_t m) {
    const cpu::onednn::MatmulShape s = shape(m);
    std::vector<float> c(static_cast<size_t>(m * n), -1.0f);
    cpu::onednn::matmul(s, DType::bf16, a.data(), b.data(), DType::f32, c.data());
    return c;
  };
  const std::vector<float> first = product(1);  // computed while cached
  const std::vector<float> kept = product(2);
  CHECK(product(2) == kept);  // used twice: protected from the one-off shapes below
  for (int64_t m = 3; m <= rows; ++m) product(m);
  CHECK(cpu::onednn::cached_primitives() <= cpu::onednn::kCachedPrimitives);
  if (cpu::onednn::has_bf16_kernels()) {  // else bf16 products widen to the f32 route: no primitives
    CHECK_FALSE(cpu::onednn::is_cached(shape(1), DType::bf16, DType::f32));  // once: dropped
    CHECK(cpu::onednn::is_cached(shape(2), DType::bf16, DType::f32));        // twice: kept
  }
  CHECK(product(1) == first);  // m = 1 was dropped: made again, the same product (exact: small integers)
  CHECK(product(2) == kept);
  double want = 0;
  for (int64_t kk = 0; kk < k; ++kk) want += static_cast<double>(a[kk].to_float()) * b[kk * n].to_float();
  CHECK(first[0] == Approx(want));
}

TEST_CASE(
    "bf16 cpu: the matrix products (matmul, linear, mlp, grouped "
    "experts) match f32",
    "[ops][bf16]") {
  check_bf16_matches_f32([](const Tensors& x) { return matmul(x[0], x[1]); }, {rnd({37, 50}, 1), rnd({50, 29}, 2)},
                         {true, true});
  check_bf16_matches_f32([](const Tensors& x) { return matmul(x[0], x[1], true, true); },
                         {rnd({50, 37}, 3), rnd({29, 50}, 4)}, {true, true});
  check_bf16_matches_f32([](const Tensors& x) { return matmul(x[0], x[1]); },
                         {rnd({3, 4, 11, 16}, 5), rnd({3, 4, 16, 9}, 6)}, {true, true});
  check_bf16_matches_f32([](const Tensors& x) { return matmul(x[0], x[1], false, true); },
                         {rnd({2, 11, 16}, 7), rnd({9, 16}, 8)}, {true, true});
  check_bf16_matches_f32([](const Tensors& x) { return matmul(x[0], x[1], true, false); },
                         {rnd({2, 16, 11}, 9), rnd({2, 16, 9}, 10)}, {true, true});
  check_bf16_matches_f32([](const Tensors& x) { return linear(x[0], x[1], x[2]); },
                         {rnd({2, 13, 48}, 11), rnd({40, 48}, 12, 0.2), rnd({40}, 13)}, {true, true, true});
  check_bf16_matches_f32([](const Tensors& x) { return linear(x[0], x[1]); }, {rnd({13, 48}, 14), rnd({40, 48}, 15)},
                         {true, true});
  check_bf16_matches_f32([](const Tensors& x) { return linear_gelu(x[0], x[1], x[2]); },
                         {rnd({13, 48}, 16), rnd({64, 48}, 17, 0.2), rnd({64}, 18)}, {true, true, true});
  check_bf16_matches_f32(
      [](const Tensors& x) { return mlp_gelu(x[0], x[1], x[2], x[3], x[4]); },
      {rnd({2, 9, 32}, 19), rnd({128, 32}, 20, 0.2), rnd({128}, 21), rnd({32, 128}, 22, 0.1), rnd({32}, 23)},
      {true, true, true, true, true});
  // Small experts (one per thread) and larger ones (threaded products); an empty
  // expert.
  for (int64_t rows : {int64_t{5}, int64_t{300}}) {
    const std::vector<int64_t> counts = {rows, 0, rows + 3, 2};
    const int64_t total = 2 * rows + 5;
    check_bf16_matches_f32([&](const Tensors& x) { return grouped_linear(x[0], x[1], counts); },
                           {rnd({total, 24}, 24), rnd({4, 40, 24}, 25, 0.2)}, {true, true});
  }
}

TEST_CASE(
    "bf16 cpu: the widened ops (norms, softmax, attention, KDA, "
    "elementwise, ...) match f32",
    "[ops][bf16]") {
  const Tensor x = rnd({3, 7, 40}, 30, 2.0), w = rnd({40}, 31), b = rnd({40}, 32), z = rnd({3, 7, 40}, 33);
  check_bf16_matches_f32([](const Tensors& in) { return layer_norm(in[0], in[1], in[2]); }, {x, w, b},
                         {true, true, true});
  check_bf16_matches_f32([](const Tensors& in) { return rms_norm(in[0], in[1]); }, {x, w}, {true, true});
  check_bf16_matches_f32([](const Tensors& in) { return gated_rms_norm(in[0], in[1], in[2]); }, {x, w, z},
                         {true, true, true});
  check_bf16_matches_f32([](const Tensors& in) { return l2_norm(in[0]); }, {x}, {true});
  check_bf16_matches_f32(
      [](const Tensors& in) {
        ResidualNorm r = add_rms_norm(in[0], in[1], in[2]);
        return Tensors{r.sum, r.normed};
      },
      {x, z, w}, {true, true, true});
  check_bf16_matches_f32(
      [](const Tensors& in) {
        ResidualNorm r = add_layer_norm(in[0], in[1], in[2], in[3]);
        return Tensors{r.sum, r.normed};
      },
      {x, z, w, b}, {true, true, true, true});
  check_bf16_matches_f32([](const Tensors& in) { return softmax(in[0]); }, {x}, {true});
  check_bf16_matches_f32([](const Tensors& in) { return log_softmax(in[0]); }, {x}, {true});
  // cross-entropy: an f32 loss from bf16 logits (as on CUDA).
  const Tensor targets =
      from_vector({1, 5, 0, 39, 7, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18}, {21}, DType::i64);
  check_bf16_matches_f32(
      [&](const Tensors& in) {
        return Tensors{cross_entropy(reshape(in[0], {21, 40}), targets)};
      },
      {x}, {true}, {0});
  // Attention [B, T, H, D], KDA, the decay gate, SiTU-GLU, the causal conv.
  const Tensor q = rnd({2, 19, 2, 16}, 34), k = rnd({2, 19, 2, 16}, 35), v = rnd({2, 19, 2, 16}, 36);
  check_bf16_matches_f32([](const Tensors& in) { return causal_attention(in[0], in[1], in[2], 0.25); }, {q, k, v},
                         {true, true, true});
  check_bf16_matches_f32([](const Tensors& in) { return situ_glu(in[0], in[1], 1.0, std::nullopt); }, {x, z},
                         {true, true});
  check_bf16_matches_f32([](const Tensors& in) { return causal_conv1d(in[0], in[1]); },
                         {rnd({2, 17, 12}, 37), rnd({12, 4}, 38, 0.5)}, {true, true});
  // Elementwise, reductions and views.
  check_bf16_matches_f32([](const Tensors& in) { return add(mul(in[0], in[1]), gelu_tanh(in[0])); }, {x, z},
                         {true, true});
  check_bf16_matches_f32([](const Tensors& in) { return Tensors{sum(in[0], 1), silu(in[0])}; }, {x}, {true});
  check_bf16_matches_f32([](const Tensors& in) { return transpose(in[0], 0, 1); }, {x}, {true});
  // The byte-moving views take bf16 as it is: the same values exactly.
  const Tensor ids = from_vector({3, 0, 3, 6, 1}, {5}, DType::i64);
  check_bf16_matches_f32(
      [&](const Tensors& in) {
        return Tensors{concat({slice(in[0], 1, 2, 5), in[1]}, 1), index_select(in[0], 1, ids), embedding(in[2], ids),
                       permute(in[0], {2, 0, 1})};
      },
      {x, z, rnd({7, 40}, 39)}, {true, true, true}, {}, 0.0, kBf16BackwardTol);
}

TEST_CASE(
    "bf16 cpu: KDA, the decay gate, the router and attention residuals "
    "match f32",
    "[ops][bf16]") {
  const int64_t B = 1, T = 37, H = 2, K = 16, V = 8;
  const Tensor q = l2_norm(rnd({B, T, H, K}, 40)), kk = l2_norm(rnd({B, T, H, K}, 41)), v = rnd({B, T, H, V}, 42);
  const Tensor g = mul_scalar(sigmoid(rnd({B, T, H, K}, 43)), -0.5), beta = sigmoid(rnd({B, T, H}, 44));
  for (int64_t chunk : {int64_t{0}, int64_t{16}}) {
    INFO("kda chunk " << chunk);
    check_bf16_matches_f32(
        [&](const Tensors& in) {
          KdaResult r = chunk == 0 ? kda_recurrent(in[0], in[1], in[2], in[3], in[4], Tensor(), 0.25)
                                   : kda_chunked(in[0], in[1], in[2], in[3], in[4], Tensor(), 0.25, chunk);
          return Tensors{r.o, r.final_state};
        },
        {q, kk, v, g, beta}, {true, true, true, true, true});
  }
  // The decay gate, with and without a lower bound.
  for (std::optional<double> lb : {std::optional<double>(), std::optional<double>(-5.0)})
    check_bf16_matches_f32([&](const Tensors& in) { return decay_gate(in[0], in[1], in[2], lb); },
                           {rnd({2, 9, 2, 16}, 52), rnd({2}, 53, 0.5), rnd({32}, 54, 0.5)}, {true, true, true});
  // attn_res over three sources.
  check_bf16_matches_f32(
      [](const Tensors& in) {
        return attn_res({in[0], in[1], in[2]}, in[3], in[4]);
      },
      {rnd({5, 24}, 45), rnd({5, 24}, 46), rnd({5, 24}, 47), rnd({24}, 48), rnd({24}, 49)},
      {true, true, true, true, true});
  // The router's selection (bf16 scores read as they are, f32 bias): the experts of the
  // f32 scores of the same values.
  const Tensor scores = rnd({6, 8}, 50).to(DType::bf16), bias = rnd({8}, 51, 0.1);
  CHECK(select_experts(scores, bias, 2) == select_experts(scores.to(DType::f32), bias, 2));
  CHECK(select_experts(scores, bias, 2, 2, 1) == select_experts(scores.to(DType::f32), bias, 2, 2, 1));
}

TEST_CASE("bf16 cpu: the same bits for 1 and 2 threads", "[ops][bf16]") {
  // oneDNN's matmul (its brgemm/gemm kernels split M and N over threads, never K, for
  // these shapes) and the widened kernels (ours: the same order for any thread count).
  ThreadsGuard guard;
  auto run = [](int threads) {
    cpu::set_num_threads(threads);
    Tensor x = rnd({64, 96}, 60).to(DType::bf16).set_requires_grad(true);
    Tensor w = rnd({200, 96}, 61, 0.2).to(DType::bf16).set_requires_grad(true);
    Tensor bias = rnd({200}, 62).to(DType::bf16).set_requires_grad(true);
    Tensor lw = rnd({200}, 63).to(DType::bf16);
    Tensor y = layer_norm(linear_gelu(x, w, bias), lw, Tensor());
    Tensor big = matmul(rnd({256, 768}, 64).to(DType::bf16), rnd({768, 768}, 65).to(DType::bf16));
    autograd::backward({y}, {rnd({64, 200}, 66).to(DType::bf16)});
    return Tensors{y, big, x.grad(), w.grad(), bias.grad()};
  };
  Tensors one = run(1), two = run(2);
  for (size_t i = 0; i < one.size(); ++i) {
    INFO("tensor " << i);
    CHECK(moetrain::testing::bitwise_equal(one[i], two[i]));
  }
}
