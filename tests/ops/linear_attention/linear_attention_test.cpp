#include "ops/linear_attention/linear_attention.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>

#include "moetrain.h"
#include "ops/cuda_vs_cpu.h"
#include "testing.h"

using namespace moetrain;
using moetrain::testing::check_gradients;
using moetrain::testing::error_of;
using moetrain::testing::rel_error;

namespace {

struct Inputs {
  Tensor q, k, v, h0;  // h0 may be undefined
  Tensors list() const { return {q, k, v, h0}; }
};

// q, k positive like feature-mapped rows (elu + 1 of randn), v randn.
Inputs make_inputs(int64_t B, int64_t T, int64_t H, int64_t K, int64_t V, bool with_h0, uint64_t seed) {
  auto feature = [&](uint64_t s) {
    std::vector<double> x = randn({B, T, H, K}, DType::f64, s).to_vector();
    for (double& e : x) e = e > 0 ? e + 1 : std::exp(e);
    return from_vector(x, {B, T, H, K}, DType::f64);
  };
  Inputs in{feature(seed), feature(seed + 1), randn({B, T, H, V}, DType::f64, seed + 2), Tensor()};
  if (with_h0) in.h0 = mul_scalar(randn({B, H, K, V}, DType::f64, seed + 3), 0.5);
  return in;
}

// o_t = q_t^T S_0 + Σ_{s<=t} (q_t · k_s) v_s, the attention form, in double: o then S_T.
std::pair<std::vector<double>, std::vector<double>> naive_linear_attention(const Inputs& in) {
  int64_t B = in.q.size(0), T = in.q.size(1), H = in.q.size(2), K = in.q.size(3), V = in.v.size(3);
  std::vector<double> q = in.q.to_vector(), k = in.k.to_vector(), v = in.v.to_vector();
  std::vector<double> S0 = in.h0.defined() ? in.h0.to_vector() : std::vector<double>(B * H * K * V);
  std::vector<double> o(B * T * H * V), S = S0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      auto row = [&](const std::vector<double>& x, int64_t t, int64_t D) { return &x[((b * T + t) * H + h) * D]; };
      for (int64_t t = 0; t < T; ++t) {
        double* ot = &o[((b * T + t) * H + h) * V];
        for (int64_t j = 0; j < V; ++j)
          for (int64_t d = 0; d < K; ++d) ot[j] += row(q, t, K)[d] * S0[((b * H + h) * K + d) * V + j];
        for (int64_t s = 0; s <= t; ++s) {
          double dot = 0;
          for (int64_t d = 0; d < K; ++d) dot += row(q, t, K)[d] * row(k, s, K)[d];
          for (int64_t j = 0; j < V; ++j) ot[j] += dot * row(v, s, V)[j];
        }
        for (int64_t d = 0; d < K; ++d)
          for (int64_t j = 0; j < V; ++j) S[((b * H + h) * K + d) * V + j] += row(k, t, K)[d] * row(v, t, V)[j];
      }
    }
  return {o, S};
}

struct Run {
  Tensor o, state;
  Tensors grads;  // q, k, v, h0
};

template <class F>
Run run(F&& fn, const Inputs& in, const Tensor& grad_o, const Tensor& grad_state) {
  Tensors leaves;
  for (const Tensor& t : in.list()) {
    Tensor c = t.defined() ? t.detach().clone() : Tensor();
    if (c.defined()) c.set_requires_grad(true);
    leaves.push_back(c);
  }
  LinearAttentionResult r = fn(leaves);
  autograd::backward({r.o, r.final_state}, {grad_o, grad_state});
  Run out{r.o.detach(), r.final_state.detach(), {}};
  for (const Tensor& l : leaves) out.grads.push_back(l.defined() ? l.grad() : Tensor());
  return out;
}

}  // namespace

TEST_CASE("linear_attention: both forms match the attention-form loop", "[ops][linear_attention]") {
  for (bool with_h0 : {false, true}) {
    DYNAMIC_SECTION("h0=" << with_h0) {
      Inputs in = make_inputs(2, 45, 3, 4, 5, with_h0, 1);
      auto [o, S] = naive_linear_attention(in);
      for (bool chunked : {false, true}) {
        INFO("chunked=" << chunked);
        LinearAttentionResult r = linear_attention(in.q, in.k, in.v, in.h0, chunked, 16);
        CHECK(rel_error(r.o, from_vector(o, r.o.shape(), DType::f64)) < 1e-13);
        CHECK(rel_error(r.final_state, from_vector(S, r.final_state.shape(), DType::f64)) < 1e-13);
      }
    }
  }
}

TEST_CASE("linear_attention: gradients match finite differences", "[ops][linear_attention]") {
  // T = 21 with C = 8: two full chunks and a tail of 5.
  Inputs a = make_inputs(2, 21, 2, 3, 4, true, 2);
  check_gradients(
      [](const Tensors& x) {
        LinearAttentionResult r = linear_attention_recurrent(x[0], x[1], x[2], x[3]);
        return Tensors{r.o, r.final_state};
      },
      a.list());
  check_gradients(
      [](const Tensors& x) {
        LinearAttentionResult r = linear_attention_chunked(x[0], x[1], x[2], x[3], 8);
        return Tensors{r.o, r.final_state};
      },
      a.list());
  Inputs b = make_inputs(1, 7, 1, 3, 2, false, 3);  // no h0
  check_gradients(
      [](const Tensors& x) {
        LinearAttentionResult r = linear_attention_chunked(x[0], x[1], x[2], Tensor(), 3);
        return Tensors{r.o, r.final_state};
      },
      {b.q, b.k, b.v});
}

TEST_CASE("linear_attention: chunked equals recurrent in f64 (outputs and gradients)", "[ops][linear_attention]") {
  double worst = 0;
  for (int64_t T : {1, 37, 64, 200})
    for (int64_t C : {1, 16, 33, 64})
      for (bool with_h0 : {false, true}) {
        INFO("T=" << T << " C=" << C << " h0=" << with_h0);
        Inputs in = make_inputs(2, T, 2, 9, 6, with_h0, 10 + T);
        Tensor grad_o = randn(in.v.shape(), DType::f64, 20), grad_state = randn({2, 2, 9, 6}, DType::f64, 21);
        Run rec = run([](const Tensors& x) { return linear_attention_recurrent(x[0], x[1], x[2], x[3]); }, in, grad_o,
                      grad_state);
        Run chk = run([C](const Tensors& x) { return linear_attention_chunked(x[0], x[1], x[2], x[3], C); }, in,
                      grad_o, grad_state);
        std::vector<std::pair<Tensor, Tensor>> pairs{{chk.o, rec.o}, {chk.state, rec.state}};
        for (size_t i = 0; i < rec.grads.size(); ++i)
          if (rec.grads[i].defined()) pairs.push_back({chk.grads[i], rec.grads[i]});
        for (auto& [a, b] : pairs) {
          double e = rel_error(a, b);
          CHECK(e < 1e-10);
          worst = std::max(worst, e);
        }
      }
  WARN("linear_attention chunked vs recurrent, f64: max relative error " << worst);
}

TEST_CASE("linear_attention: f32 agrees with f64", "[ops][linear_attention]") {
  Inputs in = make_inputs(1, 200, 2, 16, 16, true, 30);
  LinearAttentionResult ref = linear_attention_recurrent(in.q, in.k, in.v, in.h0);
  for (bool chunked : {false, true}) {
    INFO("chunked=" << chunked);
    LinearAttentionResult r = linear_attention(in.q.to(DType::f32), in.k.to(DType::f32), in.v.to(DType::f32),
                                               in.h0.to(DType::f32), chunked, 64);
    CHECK(rel_error(r.o.to(DType::f64), ref.o) < 1e-5);
    CHECK(rel_error(r.final_state.to(DType::f64), ref.final_state) < 1e-5);
  }
}

TEST_CASE("linear_attention_decode_step: token by token equals the recurrent form", "[ops][linear_attention]") {
  for (DType dtype : {DType::f32, DType::f64}) {
    DYNAMIC_SECTION(dtype_name(dtype)) {
      const int64_t T = 9;
      Inputs in = make_inputs(2, T, 2, 8, 6, true, 40);
      Tensor q = in.q.to(dtype), k = in.k.to(dtype), v = in.v.to(dtype), h0 = in.h0.to(dtype);
      LinearAttentionResult full = linear_attention_recurrent(q, k, v, h0);
      Tensor state = h0.clone();
      auto token = [&](const Tensor& x, int64_t t) { return slice(x, 1, t, t + 1).contiguous(); };
      for (int64_t t = 0; t < T; ++t) {
        Tensor o = linear_attention_decode_step(token(q, t), token(k, t), token(v, t), state);
        CHECK(moetrain::testing::bitwise_equal(o, token(full.o, t)));
      }
      CHECK(moetrain::testing::bitwise_equal(state, full.final_state));
    }
  }
}

TEST_CASE("linear_attention: CUDA matches CPU, both forms, forward and every gradient",
          "[ops][linear_attention][cuda]") {
  if (!moetrain::testing::gpu_available()) return;
  for (bool chunked : {false, true})
    for (DType dtype : {DType::f32, DType::f64, DType::bf16}) {
      // 130 steps: three checkpoint segments of the CUDA kernel, the last one short.
      Inputs in = make_inputs(2, 130, 3, 9, 40, true, 80);
      INFO(fmt::format("{} chunked {}", dtype, chunked));
      moetrain::testing::check_cuda_matches_cpu(
          [&](const Tensors& x) {
            LinearAttentionResult r = linear_attention(x[0], x[1], x[2], x[3], chunked, 16);
            return Tensors{r.o, r.final_state};
          },
          in.list(), {true, true, true, true}, dtype, moetrain::testing::tolerance_for(dtype));
    }
}

TEST_CASE("linear_attention: bad shapes are reported", "[ops][linear_attention][errors]") {
  Inputs in = make_inputs(2, 5, 2, 3, 6, true, 60);
  CHECK_THAT(error_of([&] { linear_attention_chunked(in.q, randn({2, 5, 2, 4}, DType::f64, 1), in.v, in.h0); }),
             Catch::Contains("linear_attention_chunked") && Catch::Contains("k is [2, 5, 2, 4]"));
  CHECK_THAT(error_of([&] { linear_attention_recurrent(in.q, in.k, randn({2, 5, 3, 6}, DType::f64, 1), in.h0); }),
             Catch::Contains("linear_attention_recurrent") && Catch::Contains("v is [2, 5, 3, 6]"));
  CHECK_THAT(error_of([&] { linear_attention_chunked(in.q, in.k, in.v, randn({2, 2, 6, 3}, DType::f64, 1)); }),
             Catch::Contains("h0 is [2, 2, 6, 3]") && Catch::Contains("[2, 2, 3, 6]"));
  CHECK_THAT(error_of([&] { linear_attention_chunked(in.q, in.k, in.v, in.h0, 0); }),
             Catch::Contains("chunk_size = 0"));
  CHECK_THAT(error_of([&] { linear_attention_recurrent(in.q.to(DType::f32), in.k, in.v, in.h0); }),
             Catch::Contains("linear_attention_recurrent") && Catch::Contains("dtype mismatch"));
  CHECK_THAT(error_of([&] { linear_attention_decode_step(in.q, in.k, in.v, in.h0.clone()); }),
             Catch::Contains("linear_attention_decode_step") && Catch::Contains("one token"));
}
