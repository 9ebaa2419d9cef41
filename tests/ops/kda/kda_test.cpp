#include "ops/kda/kda.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>

#include "backend/cpu/parallel.h"
#include "moetrain.h"
#include "ops/kda/kda_kernels.h"
#include "ops/common/math.h"
#include "ops/cuda_vs_cpu.h"
#include "testing.h"

using namespace moetrain;
using moetrain::testing::check_gradients;
using moetrain::testing::error_of;
using moetrain::testing::rel_error;

namespace {

// Decay settings: mild (long memory), the K3 lower-bound gate range (-5, 0),
// strong decays as the softplus gate can produce (down to about -60), and a mix of
// mild and strong entries (large |γ| next to small differences γ_i - γ_j).
enum class Decay { mild, lower_bound, strong, mixed };

const char* decay_name(Decay d) {
  switch (d) {
    case Decay::mild:
      return "mild";
    case Decay::lower_bound:
      return "lower_bound";
    case Decay::strong:
      return "strong";
    case Decay::mixed:
      return "mixed";
  }
  return "";
}

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

struct Inputs {
  Tensor q, k, v, g, beta, h0;  // h0 may be undefined
  Tensors list() const { return {q, k, v, g, beta, h0}; }
  Inputs to(DType dtype) const {
    return {q.to(dtype), k.to(dtype), v.to(dtype), g.to(dtype), beta.to(dtype), h0.defined() ? h0.to(dtype) : h0};
  }
};

// L2-normalised q, k (as the layer passes them), beta = σ(randn), g per `decay`.
Inputs make_inputs(int64_t B, int64_t T, int64_t H, int64_t HV, int64_t K, int64_t V, Decay decay, bool with_h0,
                   uint64_t seed) {
  auto unit_rows = [&](uint64_t s) {
    std::vector<double> x = randn({B, T, H, K}, DType::f64, s).to_vector();
    for (int64_t r = 0; r < B * T * H; ++r) {
      double n = 0;
      for (int64_t d = 0; d < K; ++d) n += x[r * K + d] * x[r * K + d];
      for (int64_t d = 0; d < K; ++d) x[r * K + d] /= std::sqrt(n) + 1e-6;
    }
    return from_vector(x, {B, T, H, K}, DType::f64);
  };
  std::vector<double> g = randn({B, T, HV, K}, DType::f64, seed + 3).to_vector();
  for (size_t i = 0; i < g.size(); ++i) {
    double& x = g[i];
    bool strong = decay == Decay::strong || (decay == Decay::mixed && (i * 2654435761u) % 7 < 2);
    if (decay == Decay::lower_bound)
      x = -5.0 * sigmoid(x);
    else if (strong)
      x = -60.0 * sigmoid(2.0 * x);
    else
      x = -0.2 * sigmoid(x);
  }
  std::vector<double> beta = randn({B, T, HV}, DType::f64, seed + 4).to_vector();
  for (double& x : beta) x = sigmoid(x);
  Inputs in{unit_rows(seed),
            unit_rows(seed + 1),
            randn({B, T, HV, V}, DType::f64, seed + 2),
            from_vector(g, {B, T, HV, K}, DType::f64),
            from_vector(beta, {B, T, HV}, DType::f64),
            Tensor()};
  if (with_h0) in.h0 = mul_scalar(randn({B, HV, K, V}, DType::f64, seed + 5), 0.5);
  return in;
}

// Direct loop over docs/model.md#kda-recurrent-form in double, GVA by index: o [B,T,HV,V] followed by S_T [B,HV,K,V].
std::pair<std::vector<double>, std::vector<double>> naive_kda(const Inputs& in, double scale) {
  int64_t B = in.q.size(0), T = in.q.size(1), H = in.q.size(2), K = in.q.size(3), HV = in.v.size(2), V = in.v.size(3),
          G = HV / H;
  std::vector<double> q = in.q.to_vector(), k = in.k.to_vector(), v = in.v.to_vector(), g = in.g.to_vector(),
                      beta = in.beta.to_vector();
  std::vector<double> o(B * T * HV * V), S = in.h0.defined() ? in.h0.to_vector() : std::vector<double>(B * HV * K * V);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t hv = 0; hv < HV; ++hv) {
      double* s = &S[(b * HV + hv) * K * V];
      int64_t h = hv / G;
      for (int64_t t = 0; t < T; ++t) {
        const double* qt = &q[((b * T + t) * H + h) * K];
        const double* kt = &k[((b * T + t) * H + h) * K];
        const double* vt = &v[((b * T + t) * HV + hv) * V];
        const double* gt = &g[((b * T + t) * HV + hv) * K];
        double bt = beta[(b * T + t) * HV + hv];
        for (int64_t d = 0; d < K; ++d)
          for (int64_t j = 0; j < V; ++j) s[d * V + j] *= std::exp(gt[d]);
        for (int64_t j = 0; j < V; ++j) {
          double pred = 0;
          for (int64_t d = 0; d < K; ++d) pred += s[d * V + j] * kt[d];
          double delta = vt[j] - pred;
          for (int64_t d = 0; d < K; ++d) s[d * V + j] += bt * kt[d] * delta;
        }
        for (int64_t j = 0; j < V; ++j) {
          double acc = 0;
          for (int64_t d = 0; d < K; ++d) acc += scale * qt[d] * s[d * V + j];
          o[((b * T + t) * HV + hv) * V + j] = acc;
        }
      }
    }
  return {o, S};
}

// Outputs and the gradients of every input under upstream gradients (grad_o, grad_state).
struct Run {
  Tensor o, state;
  Tensors grads;  // q, k, v, g, beta, h0 (h0: undefined without h0)
};

template <class F>
Run run(F&& fn, const Inputs& in, const Tensor& grad_o, const Tensor& grad_state) {
  Tensors leaves;
  for (const Tensor& t : in.list()) {
    Tensor c = t.defined() ? t.detach().clone() : Tensor();
    if (c.defined()) c.set_requires_grad(true);
    leaves.push_back(c);
  }
  KdaResult r = fn(leaves);
  autograd::backward({r.o, r.final_state}, {grad_o, grad_state});
  Run out{r.o.detach(), r.final_state.detach(), {}};
  for (const Tensor& l : leaves) out.grads.push_back(l.defined() ? l.grad() : Tensor());
  return out;
}

const char* kInputNames[] = {"q", "k", "v", "g", "beta", "h0"};

}  // namespace

TEST_CASE("kda_recurrent: forward matches a naive loop", "[ops][kda]") {
  for (bool with_h0 : {false, true}) {
    DYNAMIC_SECTION("h0=" << with_h0) {
      Inputs in = make_inputs(2, 70, 2, 4, 3, 5, Decay::lower_bound, with_h0, 1);
      KdaResult r = kda_recurrent(in.q, in.k, in.v, in.g, in.beta, in.h0, 0.6);
      auto [o, S] = naive_kda(in, 0.6);
      CHECK(rel_error(r.o, from_vector(o, r.o.shape(), DType::f64)) < 1e-13);
      CHECK(rel_error(r.final_state, from_vector(S, r.final_state.shape(), DType::f64)) < 1e-13);
    }
  }
}

TEST_CASE("kda_recurrent: gradients match finite differences", "[ops][kda]") {
  auto fn = [](const Tensors& in) {
    KdaResult r = kda_recurrent(in[0], in[1], in[2], in[3], in[4], in[5], 0.7);
    return Tensors{r.o, r.final_state};
  };
  Inputs a = make_inputs(2, 7, 2, 4, 3, 5, Decay::lower_bound, true, 2);
  check_gradients(fn, a.list());
  Inputs b = make_inputs(1, 7, 1, 1, 3, 5, Decay::mild, false, 3);  // no h0, one head
  check_gradients(fn, b.list());
  Inputs c = make_inputs(1, 70, 1, 2, 2, 3, Decay::lower_bound, true, 4);  // crosses a recompute segment (64)
  check_gradients(fn, c.list());
}

TEST_CASE("kda_chunked: forward and gradients match the recurrent form in f64", "[ops][kda]") {
  // Every gradient under random upstream gradients of o and of the final state.
  double worst = 0;
  for (Decay decay : {Decay::mild, Decay::lower_bound, Decay::strong, Decay::mixed})
    for (int64_t T : {1, 37, 64, 200})
      for (int64_t C : {1, 16, 33, 64})
        for (bool with_h0 : {false, true}) {
          INFO(decay_name(decay) << " T=" << T << " C=" << C << " h0=" << with_h0);
          {
            Inputs in = make_inputs(2, T, 2, 4, 9, 6, decay, with_h0, 10 + T);
            Tensor grad_o = randn(in.v.shape(), DType::f64, 20), grad_state = randn({2, 4, 9, 6}, DType::f64, 21);
            Run rec = run([&](const Tensors& x) { return kda_recurrent(x[0], x[1], x[2], x[3], x[4], x[5], 0.4); }, in,
                          grad_o, grad_state);
            Run chk = run([&](const Tensors& x) { return kda_chunked(x[0], x[1], x[2], x[3], x[4], x[5], 0.4, C); }, in,
                          grad_o, grad_state);
            double e = rel_error(chk.o, rec.o);
            CHECK(e < 1e-10);
            worst = std::max(worst, e);
            e = rel_error(chk.state, rec.state);
            CHECK(e < 1e-10);
            worst = std::max(worst, e);
            for (size_t i = 0; i < rec.grads.size(); ++i) {
              if (!rec.grads[i].defined()) continue;
              INFO("grad " << kInputNames[i]);
              e = rel_error(chk.grads[i], rec.grads[i]);
              CHECK(e < 1e-10);
              worst = std::max(worst, e);
            }
          }
        }
  WARN("kda_chunked vs kda_recurrent, f64: max relative error " << worst);
}

TEST_CASE("kda_chunked: gradients match finite differences", "[ops][kda]") {
  // T = 21 with C = 8: two full chunks and a tail of 5; C = 20 with sub-chunks of 16 and 4.
  // Mixed decay puts sub-chunks on both in-chunk paths (matmul with a reference row, pairwise).
  for (auto [decay, C] : {std::pair{Decay::lower_bound, int64_t{8}}, std::pair{Decay::mixed, int64_t{20}}}) {
    DYNAMIC_SECTION(decay_name(decay) << " C=" << C) {
      auto fn = [C](const Tensors& in) {
        KdaResult r = kda_chunked(in[0], in[1], in[2], in[3], in[4], in[5], 0.7, C);
        return Tensors{r.o, r.final_state};
      };
      Inputs a = make_inputs(1, 21, 1, 2, 3, 4, decay, true, 5);
      check_gradients(fn, a.list());
    }
  }
}

TEST_CASE("kda_chunked: f32 agrees with the f64 recurrent form", "[ops][kda]") {
  // Tolerance: errors relative to the largest |reference| of each tensor. f32 rounds
  // at 6e-8; an output sums O(C + K) decayed products of O(1) terms per chunk and
  // the state carries rounding across chunks, but every step is non-expansive
  // (|e^g| <= 1, ||I - β k k^T|| <= 1 for unit k), so errors do not compound with T.
  // Measured ~1.4e-6 here; 2e-5 leaves room for other BLAS kernels and
  // summation orders while still catching any wrong term (those are O(1)).
  const double kTolerance = 2e-5;
  double worst_chunked = 0, worst_recurrent = 0;
  struct Case {
    Decay decay;
    int64_t H, HV, K, V;
  };
  for (Case c :
       {Case{Decay::mild, 2, 4, 32, 16}, Case{Decay::lower_bound, 2, 4, 32, 16}, Case{Decay::strong, 2, 4, 32, 16},
        Case{Decay::mixed, 2, 4, 32, 16}, Case{Decay::lower_bound, 1, 1, 64, 64}, Case{Decay::mixed, 1, 1, 64, 64}}) {
    INFO(decay_name(c.decay) << " K=" << c.K << " V=" << c.V);
    {
      Inputs in = make_inputs(1, 200, c.H, c.HV, c.K, c.V, c.decay, true, 30);
      Tensor grad_o = randn(in.v.shape(), DType::f64, 31), grad_state = randn(in.h0.shape(), DType::f64, 32);
      Run ref = run([&](const Tensors& x) { return kda_recurrent(x[0], x[1], x[2], x[3], x[4], x[5], 0.25); }, in,
                    grad_o, grad_state);
      Inputs in32 = in.to(DType::f32);
      Tensor go32 = grad_o.to(DType::f32), gs32 = grad_state.to(DType::f32);
      Run chk = run([&](const Tensors& x) { return kda_chunked(x[0], x[1], x[2], x[3], x[4], x[5], 0.25, 64); }, in32,
                    go32, gs32);
      Run rec = run([&](const Tensors& x) { return kda_recurrent(x[0], x[1], x[2], x[3], x[4], x[5], 0.25); }, in32,
                    go32, gs32);
      for (auto [r, worst] : {std::pair{&chk, &worst_chunked}, std::pair{&rec, &worst_recurrent}}) {
        std::vector<std::pair<Tensor, Tensor>> pairs{{r->o, ref.o}, {r->state, ref.state}};
        for (size_t i = 0; i < ref.grads.size(); ++i) pairs.push_back({r->grads[i], ref.grads[i]});
        for (size_t i = 0; i < pairs.size(); ++i) {
          INFO((r == &chk ? "chunked" : "recurrent") << " tensor " << i);
          double e = rel_error(pairs[i].first.to(DType::f64), pairs[i].second);
          CHECK(e < kTolerance);
          *worst = std::max(*worst, e);
        }
      }
    }
  }
  WARN("f32 vs f64 recurrent: max relative error chunked " << worst_chunked << ", recurrent " << worst_recurrent);
}

// The copies of the chunked kernels this CPU can run (kda_kernels.h), narrowest first.
using moetrain::testing::runnable_isas;

TEST_CASE("kda_chunked: the portable, AVX2 and AVX-512 copies of the kernels agree", "[ops][kda]") {
  // kda_cpu.cpp compiles the chunked kernels three times (the build's baseline ISA, AVX2 + FMA,
  // AVX-512; picked at run time). Each must meet the recurrent reference; they differ only by
  // rounding (FMA contraction, vector exp lanes), so they agree to f64 / f32 precision.
  // Copies the CPU lacks are skipped (WARN). K = 16 / 64 / 128 (V 8 / 64 / 128): off and on
  // the 64-byte vector blocks, and the benchmark's sizes.
  std::vector<cpu::VectorIsa> isas = runnable_isas();
  if (isas.size() < 3) WARN("this CPU runs " << isas.size() << " of the 3 copies; the others are not checked");
  struct Case {
    int64_t T, H, HV, K, V;
  };
  for (Case c : {Case{150, 2, 4, 16, 8}, Case{150, 1, 2, 64, 64}, Case{100, 1, 1, 128, 128}})
    for (Decay decay : {Decay::lower_bound, Decay::mixed})
      for (DType dtype : {DType::f64, DType::f32}) {
        INFO(decay_name(decay) << " " << dtype_name(dtype) << " K=" << c.K << " V=" << c.V);
        Inputs in = make_inputs(2, c.T, c.H, c.HV, c.K, c.V, decay, true, 70);
        Tensor grad_o = randn(in.v.shape(), DType::f64, 71), grad_state = randn(in.h0.shape(), DType::f64, 72);
        Run ref = run([&](const Tensors& x) { return kda_recurrent(x[0], x[1], x[2], x[3], x[4], x[5], 0.3); }, in,
                      grad_o, grad_state);
        std::vector<Run> runs;
        for (cpu::VectorIsa isa : isas) {
          cpu::kda_chunked_force_isa(isa);
          REQUIRE(cpu::kda_chunked_isa() == isa);
          runs.push_back(run([&](const Tensors& x) { return kda_chunked(x[0], x[1], x[2], x[3], x[4], x[5], 0.3, 64); },
                             in.to(dtype), grad_o.to(dtype), grad_state.to(dtype)));
        }
        cpu::kda_chunked_unforce_isa();
        const double to_ref = dtype == DType::f64 ? 1e-10 : 2e-5, between = dtype == DType::f64 ? 1e-12 : 2e-6;
        for (size_t r = 0; r < runs.size(); ++r) {
          INFO("copy " << cpu::vector_isa_name(isas[r]));
          std::vector<std::pair<Tensor, Tensor>> pairs{{runs[r].o, runs[0].o}, {runs[r].state, runs[0].state}};
          std::vector<Tensor> refs{ref.o, ref.state};
          for (size_t i = 0; i < ref.grads.size(); ++i) {
            pairs.push_back({runs[r].grads[i], runs[0].grads[i]});
            refs.push_back(ref.grads[i]);
          }
          for (size_t i = 0; i < pairs.size(); ++i) {
            INFO("tensor " << i);
            CHECK(rel_error(pairs[i].first.to(DType::f64), refs[i]) < to_ref);
            CHECK(rel_error(pairs[i].first.to(DType::f64), pairs[i].second.to(DType::f64)) < between);
          }
        }
      }
}

TEST_CASE("kda_chunked: results do not depend on the thread count", "[ops][kda]") {
  // One (batch, value head) task runs start to end on one thread with the same code, so
  // 1, 2 and 3 threads give the same bits (B·HV = 4 tasks: uneven splits included), in
  // every copy of the kernels this CPU runs.
  const int before = cpu::num_threads();
  for (int64_t KV : {64, 128})
    for (cpu::VectorIsa isa : runnable_isas()) {
      INFO("copy " << cpu::vector_isa_name(isa) << " K=V=" << KV);
      cpu::kda_chunked_force_isa(isa);
      Inputs in = make_inputs(1, 150, 2, 4, KV, KV, Decay::lower_bound, true, 80).to(DType::f32);
      Tensor grad_o = randn(in.v.shape(), DType::f32, 81), grad_state = randn(in.h0.shape(), DType::f32, 82);
      auto chunked = [&] {
        return run([&](const Tensors& x) { return kda_chunked(x[0], x[1], x[2], x[3], x[4], x[5], 0.125, 64); }, in,
                   grad_o, grad_state);
      };
      cpu::set_num_threads(1);
      Run one = chunked();
      for (int threads : {2, 3}) {
        cpu::set_num_threads(threads);
        Run many = chunked();
        INFO(threads << " threads");
        CHECK(moetrain::testing::bitwise_equal(many.o, one.o));
        CHECK(moetrain::testing::bitwise_equal(many.state, one.state));
        for (size_t i = 0; i < one.grads.size(); ++i)
          CHECK(moetrain::testing::bitwise_equal(many.grads[i], one.grads[i]));
      }
    }
  cpu::kda_chunked_unforce_isa();
  cpu::set_num_threads(before);
}

#if defined(__x86_64__) && defined(__GNUC__)
namespace {
// exp_approx as the chunked kernels' AVX2 copy compiles it: inlined into an avx2,fma
// function, vectorised, with a*b+c contracted into FMAs (other rounding than the
// portable build that tests/ops/common/math_test.cpp checks).
[[gnu::target("avx2,fma"), gnu::flatten]] void exp_approx_avx2(float* y, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = cpu::exp_approx(x[i]);
}
// The same as the AVX-512 copy compiles it (16 lanes).
[[gnu::target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,prefer-vector-width=512"), gnu::flatten]] void
exp_approx_avx512(float* y, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = cpu::exp_approx(x[i]);
}
}  // namespace

TEST_CASE("kda: exp_approx compiled for AVX2 + FMA and for AVX-512 is within 2 ulp of exp", "[ops][kda]") {
  for (cpu::VectorIsa isa : {cpu::VectorIsa::avx2, cpu::VectorIsa::avx512}) {
    INFO(cpu::vector_isa_name(isa) << " copy");
    if (cpu::cpu_vector_isa() < isa) {
      WARN("no " << cpu::vector_isa_name(isa) << " on this CPU: its copy is not checked");
      continue;
    }
    // The kernels' exponents: <= 0 (pairs i >= j, inter-chunk factors) and up to +40 (the
    // diagonal sub-chunk reference, kReferenceSpan); below -87.34 exp_approx flushes to 0.
    std::vector<float> x;
    for (float v = -87.33f; v < 41.0f; v += 0.000513f) x.push_back(v);
    for (float v : {-87.4f, -88.0f, -100.0f, -1000.0f, -INFINITY, 0.0f}) x.push_back(v);
    std::vector<float> y(x.size());
    if (isa == cpu::VectorIsa::avx2) exp_approx_avx2(y.data(), x.data(), static_cast<int64_t>(x.size()));
    else exp_approx_avx512(y.data(), x.data(), static_cast<int64_t>(x.size()));
    double worst = 0;
    float worst_x = 0;
    for (size_t i = 0; i + 6 < x.size(); ++i) {
      double ref = std::exp(static_cast<double>(x[i]));
      double rel = std::abs(y[i] - ref) / ref;
      if (rel > worst) worst = rel, worst_x = x[i];
    }
    INFO("worst at x = " << worst_x << ": " << worst);
    CHECK(worst < 2.4e-7);  // 2 ulp of float
    for (size_t i = x.size() - 6; i + 1 < x.size(); ++i) CHECK(y[i] == 0.0f);  // underflow: 0
    CHECK(y.back() == 1.0f);
  }
}
#endif

TEST_CASE("kda_decode_step: token by token equals kda_recurrent", "[ops][kda]") {
  for (DType dtype : {DType::f32, DType::f64}) {
    DYNAMIC_SECTION(dtype_name(dtype)) {
      const int64_t B = 2, T = 9, H = 2, HV = 4, K = 8, V = 6;
      Inputs in = make_inputs(B, T, H, HV, K, V, Decay::lower_bound, true, 40).to(dtype);
      KdaResult full = kda_recurrent(in.q, in.k, in.v, in.g, in.beta, in.h0, 0.35);
      Tensor state = in.h0.clone();
      std::vector<double> o_full = full.o.to_vector();
      auto token = [&](const Tensor& x, int64_t t) {  // rows of token t as a [B, 1, ...] tensor
        std::vector<double> all = x.to_vector();
        int64_t row = x.numel() / (B * T);
        std::vector<double> sel;
        for (int64_t b = 0; b < B; ++b)
          sel.insert(sel.end(), all.begin() + (b * T + t) * row, all.begin() + (b * T + t + 1) * row);
        return from_vector(sel, x.shape().with(1, 1), dtype);
      };
      for (int64_t t = 0; t < T; ++t) {
        Tensor o = kda_decode_step(token(in.q, t), token(in.k, t), token(in.v, t), token(in.g, t), token(in.beta, t),
                                   state, 0.35);
        CHECK(moetrain::testing::bitwise_equal(o, token(full.o, t)));
      }
      CHECK(moetrain::testing::bitwise_equal(state, full.final_state));
    }
  }
}

TEST_CASE("kda: CUDA matches CPU, both modes, forward and every gradient", "[ops][kda][cuda]") {
  if (!moetrain::testing::gpu_available()) return;
  struct Case {
    int64_t B, T, H, HV, K, V;
  };
  // Off the 64-step checkpoint segments, the chunks and the 32-thread warps; grouped
  // value heads; the K3 head size (128) with a block of 128 threads.
  for (Case c : {Case{2, 70, 2, 4, 20, 12}, Case{1, 129, 1, 1, 7, 33}, Case{1, 100, 2, 2, 128, 128}}) {
    Inputs in = make_inputs(c.B, c.T, c.H, c.HV, c.K, c.V, Decay::lower_bound, true, 70);
    for (DType dtype : {DType::f32, DType::f64, DType::bf16})
      for (int64_t chunk : {int64_t{0}, int64_t{16}, int64_t{64}}) {  // 0: the recurrent form
        const KdaMode mode = chunk == 0 ? KdaMode::recurrent : KdaMode::chunked;
        INFO(fmt::format("{} {} {} chunk {}", in.v.shape(), dtype, kda_mode_name(mode), chunk));
        const double scale = 1.0 / std::sqrt(static_cast<double>(c.K));
        moetrain::testing::check_cuda_matches_cpu(
            [&](const Tensors& x) {
              KdaResult r = kda(x[0], x[1], x[2], x[3], x[4], x[5], scale, mode, chunk);
              return Tensors{r.o, r.final_state};
            },
            in.list(), {true, true, true, true, true, true}, dtype, moetrain::testing::tolerance_for(dtype));
      }
  }
  // The chunked form on tensor cores (TF32 products, ops/kda/kda_tc.h) for f32 and bf16:
  // shapes with K, V multiples of 16 (V = 48: tiles of 16 columns).
  // Column tiles of 32 and 16 (set_kda_scan_columns) where V allows.
  cuda::set_kda_tensor_cores(true);
  struct Restore {
    ~Restore() {
      cuda::set_kda_tensor_cores(false);
      cuda::set_kda_scan_columns(0);
    }
  } restore;
  for (Case c : {Case{2, 70, 2, 4, 32, 16}, Case{1, 100, 2, 2, 128, 128}, Case{1, 129, 1, 1, 16, 48}}) {
    Inputs tc = make_inputs(c.B, c.T, c.H, c.HV, c.K, c.V, Decay::lower_bound, true, 72);
    for (DType dtype : {DType::f32, DType::bf16})
      for (int64_t chunk : {int64_t{16}, int64_t{64}}) {
        const int columns = chunk == 16 ? 16 : 32;  // 32 where it divides V, else the automatic tile
        cuda::set_kda_scan_columns(columns);
        INFO(fmt::format("tensor cores {} {} chunk {} columns {}", tc.v.shape(), dtype, chunk, columns));
        const double scale = 1.0 / std::sqrt(static_cast<double>(c.K));
        moetrain::testing::check_cuda_matches_cpu(
            [&](const Tensors& x) {
              KdaResult r = kda(x[0], x[1], x[2], x[3], x[4], x[5], scale, KdaMode::chunked, chunk);
              return Tensors{r.o, r.final_state};
            },
            tc.list(), {true, true, true, true, true, true}, dtype,
            dtype == DType::f32 ? moetrain::testing::CudaCompare{5e-3, 1e-2} : moetrain::testing::tolerance_for(dtype));
      }
  }
  // The decode step on CUDA updates the state as on the CPU.
  Inputs in = make_inputs(2, 1, 2, 4, 8, 6, Decay::lower_bound, true, 71);
  Tensor state = in.h0.clone(), state_gpu = in.h0.to(kCuda);
  Tensor o = kda_decode_step(in.q, in.k, in.v, in.g, in.beta, state, 0.35);
  Tensor o_gpu = kda_decode_step(in.q.to(kCuda), in.k.to(kCuda), in.v.to(kCuda), in.g.to(kCuda), in.beta.to(kCuda),
                                 state_gpu, 0.35);
  CHECK(rel_error(o_gpu.to(kCpu), o) < 1e-12);
  CHECK(rel_error(state_gpu.to(kCpu), state) < 1e-12);
}

TEST_CASE("kda: CUDA chunked results do not depend on the scans' column tile", "[ops][kda][cuda]") {
  if (!moetrain::testing::gpu_available()) return;
  // Every column of S is scanned alone, in the same order whatever the tile
  // (ops/kda/kda_tc.h: kda_scan_columns): the same bits for every tile a path takes,
  // forward and every gradient; V = 128 (all tiles) and 48 (not a multiple of 32 or 64).
  struct Restore {
    ~Restore() {
      cuda::set_kda_tensor_cores(false);
      cuda::set_kda_scan_columns(0);
    }
  } restore;
  for (int64_t V : {128, 48}) {
    Inputs in = make_inputs(1, 100, 2, 2, 32, V, Decay::lower_bound, true, 73);
    for (bool tensor_cores : {false, true}) {
      cuda::set_kda_tensor_cores(tensor_cores);
      Tensors first;
      for (int columns : {0, 8, 16, 32, 64}) {
        if (tensor_cores && (columns == 8 || columns == 64 || (columns > 0 && V % columns != 0))) continue;
        cuda::set_kda_scan_columns(columns);
        INFO(fmt::format("V {} tensor cores {} columns {}", V, tensor_cores, columns));
        Tensors x;
        for (const Tensor& t : in.list()) x.push_back(t.to(DType::f32).to(kCuda).detach().set_requires_grad());
        KdaResult r = kda(x[0], x[1], x[2], x[3], x[4], x[5], 0.25, KdaMode::chunked, 64);
        autograd::backward({r.o, r.final_state}, {randn(r.o.shape(), DType::f32, 5).to(kCuda),
                                                  randn(r.final_state.shape(), DType::f32, 6).to(kCuda)});
        Tensors got{r.o.to(kCpu), r.final_state.to(kCpu)};
        for (const Tensor& t : x) got.push_back(t.grad().to(kCpu));
        if (first.empty()) first = got;
        for (size_t i = 0; i < got.size(); ++i) {
          INFO("output or gradient " << i);
          CHECK(moetrain::testing::bitwise_equal(got[i], first[i]));
        }
      }
    }
  }
}

TEST_CASE("kda: mode dispatch", "[ops][kda]") {
  Inputs in = make_inputs(1, 20, 1, 1, 4, 4, Decay::lower_bound, false, 50);
  for (KdaMode mode : {KdaMode::recurrent, KdaMode::chunked}) {
    KdaResult a = kda(in.q, in.k, in.v, in.g, in.beta, in.h0, 0.5, mode, 8);
    KdaResult b = mode == KdaMode::recurrent ? kda_recurrent(in.q, in.k, in.v, in.g, in.beta, in.h0, 0.5)
                                             : kda_chunked(in.q, in.k, in.v, in.g, in.beta, in.h0, 0.5, 8);
    CHECK(moetrain::testing::bitwise_equal(a.o, b.o));
    CHECK(parse_kda_mode(kda_mode_name(mode)) == mode);
  }
  CHECK_THAT(error_of([] { parse_kda_mode("fast"); }), Catch::Contains("'fast'") && Catch::Contains("chunked"));
  // A chunk longer than the sequence is one chunk of T.
  KdaResult one = kda_chunked(in.q, in.k, in.v, in.g, in.beta, in.h0, 0.5, 1 << 20);
  CHECK(rel_error(one.o, kda_recurrent(in.q, in.k, in.v, in.g, in.beta, in.h0, 0.5).o) < 1e-12);
}

TEST_CASE("kda: bad shapes are reported", "[ops][kda][errors]") {
  Inputs in = make_inputs(2, 5, 2, 4, 3, 6, Decay::lower_bound, true, 60);
  CHECK_THAT(error_of([&] {
               kda_chunked(in.q, randn({2, 5, 2, 4}, DType::f64, 1), in.v, in.g, in.beta, in.h0, 1);
             }),
             Catch::Contains("kda_chunked") && Catch::Contains("k is [2, 5, 2, 4]"));
  CHECK_THAT(
      error_of([&] {
        kda_recurrent(in.q, in.k, randn({2, 5, 3, 6}, DType::f64, 1), in.g, in.beta, in.h0, 1);
      }),
      Catch::Contains("kda_recurrent") && Catch::Contains("v is [2, 5, 3, 6]") && Catch::Contains("multiple of H = 2"));
  CHECK_THAT(error_of([&] {
               kda_recurrent(in.q, in.k, in.v, randn({2, 5, 2, 3}, DType::f64, 1), in.beta, in.h0, 1);
             }),
             Catch::Contains("g is [2, 5, 2, 3]") && Catch::Contains("[2, 5, 4, 3]"));
  CHECK_THAT(error_of([&] {
               kda_chunked(in.q, in.k, in.v, in.g, randn({2, 5, 2}, DType::f64, 1), in.h0, 1);
             }),
             Catch::Contains("beta is [2, 5, 2]") && Catch::Contains("[2, 5, 4]"));
  CHECK_THAT(error_of([&] {
               kda_chunked(in.q, in.k, in.v, in.g, in.beta, randn({2, 4, 6, 3}, DType::f64, 1), 1);
             }),
             Catch::Contains("h0 is [2, 4, 6, 3]") && Catch::Contains("[2, 4, 3, 6]"));
  CHECK_THAT(error_of([&] { kda_chunked(in.q, in.k, in.v, in.g, in.beta, in.h0, 1, 0); }),
             Catch::Contains("chunk_size = 0"));
  CHECK_THAT(error_of([&] { kda_recurrent(in.q.to(DType::f32), in.k, in.v, in.g, in.beta, in.h0, 1); }),
             Catch::Contains("kda_recurrent") && Catch::Contains("dtype mismatch"));
  CHECK_THAT(
      error_of([&] { kda_decode_step(in.q, in.k, in.v, in.g, in.beta, in.h0.clone(), 1); }),
      Catch::Contains("kda_decode_step") && Catch::Contains("q is [2, 5, 2, 3]") && Catch::Contains("one token"));
  CHECK_THAT(error_of([&] { kda_decode_step(in.q, in.k, in.v, in.g, in.beta, Tensor(), 1); }),
             Catch::Contains("kda_decode_step: state is undefined"));
}

// ---------------------------------------------------------------------------------------------------
// DeltaNet and Gated DeltaNet: the KDA op with g = 0 and with one decay per value head.

namespace {

// Log decays per value head and step, [B, T, HV]: -0.3 σ(randn) (long memories).
Tensor head_log_decays(int64_t B, int64_t T, int64_t HV, uint64_t seed) {
  std::vector<double> g = randn({B, T, HV}, DType::f64, seed).to_vector();
  for (double& x : g) x = -0.3 * sigmoid(x);
  return from_vector(g, {B, T, HV}, DType::f64);
}

// The gated delta rule written with a scalar decay, in double (Yang et al. 2024, Eq. 10):
//   S_t = α_t (I - β_t k_t k_t^T) S_{t-1} + β_t k_t v_t^T,  o_t = S_t^T (scale q_t);
// g undefined: α = 1 (DeltaNet). o [B,T,HV,V] followed by S_T [B,HV,K,V].
std::pair<std::vector<double>, std::vector<double>> naive_gated_delta(const Inputs& in, const Tensor& g,
                                                                      double scale) {
  int64_t B = in.q.size(0), T = in.q.size(1), H = in.q.size(2), K = in.q.size(3), HV = in.v.size(2), V = in.v.size(3),
          G = HV / H;
  std::vector<double> q = in.q.to_vector(), k = in.k.to_vector(), v = in.v.to_vector(), beta = in.beta.to_vector();
  std::vector<double> gv = g.defined() ? g.to_vector() : std::vector<double>(B * T * HV, 0.0);
  std::vector<double> o(B * T * HV * V), S = in.h0.defined() ? in.h0.to_vector() : std::vector<double>(B * HV * K * V);
  std::vector<double> kS(V);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t hv = 0; hv < HV; ++hv) {
      double* s = &S[(b * HV + hv) * K * V];
      for (int64_t t = 0; t < T; ++t) {
        const double* qt = &q[((b * T + t) * H + hv / G) * K];
        const double* kt = &k[((b * T + t) * H + hv / G) * K];
        const double* vt = &v[((b * T + t) * HV + hv) * V];
        const double alpha = std::exp(gv[(b * T + t) * HV + hv]), bt = beta[(b * T + t) * HV + hv];
        for (int64_t j = 0; j < V; ++j) {  // k^T S_{t-1}
          kS[j] = 0;
          for (int64_t d = 0; d < K; ++d) kS[j] += kt[d] * s[d * V + j];
        }
        for (int64_t d = 0; d < K; ++d)
          for (int64_t j = 0; j < V; ++j)
            s[d * V + j] = alpha * (s[d * V + j] - bt * kt[d] * kS[j]) + bt * kt[d] * vt[j];
        for (int64_t j = 0; j < V; ++j) {
          double acc = 0;
          for (int64_t d = 0; d < K; ++d) acc += scale * qt[d] * s[d * V + j];
          o[((b * T + t) * HV + hv) * V + j] = acc;
        }
      }
    }
  return {o, S};
}

struct DeltaRun {
  Tensor o, state;
  Tensors grads;  // q, k, v, g (gated only), beta, h0
};

// mode "delta" (no g) or "gated"; backward under (grad_o, grad_state).
DeltaRun run_delta(bool gated, KdaMode mode, int64_t C, const Inputs& in, const Tensor& g, const Tensor& grad_o,
                   const Tensor& grad_state) {
  Tensors leaves;
  for (const Tensor& t : Tensors{in.q, in.k, in.v, g, in.beta, in.h0}) {
    Tensor c = t.defined() ? t.detach().clone() : Tensor();
    if (c.defined()) c.set_requires_grad(true);
    leaves.push_back(c);
  }
  KdaResult r = gated ? gated_delta_rule(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4], leaves[5], 0.4, mode, C)
                      : delta_rule(leaves[0], leaves[1], leaves[2], leaves[4], leaves[5], 0.4, mode, C);
  autograd::backward({r.o, r.final_state}, {grad_o, grad_state});
  DeltaRun out{r.o.detach(), r.final_state.detach(), {}};
  for (const Tensor& l : leaves) out.grads.push_back(l.defined() ? l.grad() : Tensor());
  return out;
}

}  // namespace

TEST_CASE("delta_rule, gated_delta_rule: forward matches the scalar-decay recurrence", "[ops][kda][delta]") {
  Inputs in = make_inputs(2, 70, 2, 4, 3, 5, Decay::mild, true, 70);
  Tensor g = head_log_decays(2, 70, 4, 71);
  for (KdaMode mode : {KdaMode::recurrent, KdaMode::chunked}) {
    INFO(kda_mode_name(mode));
    auto [o, S] = naive_gated_delta(in, Tensor(), 0.6);
    KdaResult d = delta_rule(in.q, in.k, in.v, in.beta, in.h0, 0.6, mode, 16);
    CHECK(rel_error(d.o, from_vector(o, d.o.shape(), DType::f64)) < 1e-12);
    CHECK(rel_error(d.final_state, from_vector(S, d.final_state.shape(), DType::f64)) < 1e-12);
    auto [og, Sg] = naive_gated_delta(in, g, 0.6);
    KdaResult gd = gated_delta_rule(in.q, in.k, in.v, g, in.beta, in.h0, 0.6, mode, 16);
    CHECK(rel_error(gd.o, from_vector(og, gd.o.shape(), DType::f64)) < 1e-12);
    CHECK(rel_error(gd.final_state, from_vector(Sg, gd.final_state.shape(), DType::f64)) < 1e-12);
  }
}

TEST_CASE("delta_rule, gated_delta_rule: chunked equals recurrent in f64 (outputs and gradients)",
          "[ops][kda][delta]") {
  double worst = 0;
  for (bool gated : {false, true})
    for (int64_t T : {1, 37, 200})
      for (int64_t C : {16, 64}) {
        INFO((gated ? "gated" : "delta") << " T=" << T << " C=" << C);
        Inputs in = make_inputs(2, T, 2, 4, 9, 6, Decay::mild, true, 80 + T);
        Tensor g = gated ? head_log_decays(2, T, 4, 81) : Tensor();
        Tensor grad_o = randn(in.v.shape(), DType::f64, 82), grad_state = randn({2, 4, 9, 6}, DType::f64, 83);
        DeltaRun rec = run_delta(gated, KdaMode::recurrent, C, in, g, grad_o, grad_state);
        DeltaRun chk = run_delta(gated, KdaMode::chunked, C, in, g, grad_o, grad_state);
        std::vector<std::pair<Tensor, Tensor>> pairs{{chk.o, rec.o}, {chk.state, rec.state}};
        for (size_t i = 0; i < rec.grads.size(); ++i)
          if (rec.grads[i].defined()) pairs.push_back({chk.grads[i], rec.grads[i]});
        for (auto& [a, b] : pairs) {
          double e = rel_error(a, b);
          CHECK(e < 1e-10);
          worst = std::max(worst, e);
        }
      }
  WARN("delta rules, chunked vs recurrent, f64: max relative error " << worst);
}

TEST_CASE("delta_rule, gated_delta_rule: gradients match finite differences", "[ops][kda][delta]") {
  for (KdaMode mode : {KdaMode::recurrent, KdaMode::chunked}) {
    DYNAMIC_SECTION(kda_mode_name(mode)) {
      Inputs in = make_inputs(1, 21, 1, 2, 3, 4, Decay::mild, true, 90);
      check_gradients(
          [mode](const Tensors& x) {
            KdaResult r = delta_rule(x[0], x[1], x[2], x[3], x[4], 0.7, mode, 8);
            return Tensors{r.o, r.final_state};
          },
          {in.q, in.k, in.v, in.beta, in.h0});
      check_gradients(
          [mode](const Tensors& x) {
            KdaResult r = gated_delta_rule(x[0], x[1], x[2], x[3], x[4], x[5], 0.7, mode, 8);
            return Tensors{r.o, r.final_state};
          },
          {in.q, in.k, in.v, head_log_decays(1, 21, 2, 91), in.beta, in.h0});
    }
  }
}

TEST_CASE("delta_rule, gated_delta_rule: decode steps equal the recurrent form", "[ops][kda][delta]") {
  const int64_t B = 2, T = 9, H = 2, HV = 4, K = 8, V = 6;
  Inputs in = make_inputs(B, T, H, HV, K, V, Decay::mild, true, 95);
  Tensor g = head_log_decays(B, T, HV, 96);
  auto token = [&](const Tensor& x, int64_t t) { return slice(x, 1, t, t + 1).contiguous(); };
  for (bool gated : {false, true}) {
    INFO((gated ? "gated" : "delta"));
    KdaResult full = gated ? gated_delta_rule(in.q, in.k, in.v, g, in.beta, in.h0, 0.35, KdaMode::recurrent)
                           : delta_rule(in.q, in.k, in.v, in.beta, in.h0, 0.35, KdaMode::recurrent);
    Tensor state = in.h0.clone();
    for (int64_t t = 0; t < T; ++t) {
      Tensor o = gated ? gated_delta_rule_decode_step(token(in.q, t), token(in.k, t), token(in.v, t), token(g, t),
                                                      token(in.beta, t), state, 0.35)
                       : delta_rule_decode_step(token(in.q, t), token(in.k, t), token(in.v, t), token(in.beta, t),
                                                state, 0.35);
      CHECK(moetrain::testing::bitwise_equal(o, token(full.o, t)));
    }
    CHECK(moetrain::testing::bitwise_equal(state, full.final_state));
  }
  // A per-channel decay is KDA's, not Gated DeltaNet's.
  CHECK_THAT(error_of([&] { gated_delta_rule(in.q, in.k, in.v, in.g, in.beta, in.h0, 1, KdaMode::chunked); }),
             Catch::Contains("gated_delta_rule: g is [2, 9, 4, 8]") && Catch::Contains("[B, T, HV]"));
}
