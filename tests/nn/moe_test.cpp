// MoE layer (docs/model.md#moe): selection, routing weights and their gradient, the
// expert plan (dispatch order, capacity), the layer against a per-token loop,
// finite differences of every parameter, and the aux-loss-free balancing.
#include <algorithm>
#include <cmath>
#include <numeric>

#include <catch2/catch.hpp>

#include "moetrain.h"
#include "nn/moe.h"
#include "testing.h"

using namespace moetrain;
using moetrain::testing::check_gradients;

namespace {

Tensor from_values(const std::vector<double>& v, const Shape& s) {
  Tensor t = empty(s, DType::f64);
  std::copy(v.begin(), v.end(), t.data<double>());
  return t;
}

MoeConfig small_moe(int64_t latent) {
  MoeConfig c;
  c.num_experts = 6;
  c.top_k = 2;
  c.num_shared_experts = 1;
  c.expert_d_ff = 5;
  c.latent_dim = latent;
  c.routed_scaling_factor = 1.7;
  return c;
}

FfnConfig expert_ffn(FfnKind kind) {
  FfnConfig f;
  f.kind = kind;
  return f;
}

}  // namespace

TEST_CASE("moe: selection takes the top-k of score + bias, lower index first on ties", "[nn][moe]") {
  Tensor s = from_values({0.1, 0.9, 0.5, 0.5,  //
                          0.3, 0.3, 0.3, 0.3},
                         {2, 4});
  Tensor no_bias = zeros({4}, DType::f32);
  CHECK(select_experts(s, no_bias, 2) == std::vector<int64_t>{1, 2, 0, 1});
  // The bias moves the selection (only the selection: weights use s, tested below).
  Tensor b = from_values({0.0, 0.0, 0.0, 0.25}, {4}).to(DType::f32);
  CHECK(select_experts(s, b, 2) == std::vector<int64_t>{1, 3, 3, 0});
  // Group-limited: 2 groups of 2; group score = the sum of its two best: {1.0, 1.0} for
  // row 0 (tie: group 0), so only experts 0, 1 are eligible.
  CHECK(select_experts(s, no_bias, 2, 2, 1) == std::vector<int64_t>{1, 0, 0, 1});
  Tensor s2 = from_values({0.2, 0.1, 0.9, 0.05, 0.6, 0.55}, {1, 6});  // 3 groups of 2: sums 0.3, 0.95, 1.15
  CHECK(select_experts(s2, zeros({6}, DType::f32), 3, 3, 2) == std::vector<int64_t>{2, 4, 5});
  CHECK_THROWS_WITH(select_experts(s2, zeros({6}, DType::f32), 5, 3, 2), Catch::Contains("at least top_k"));
}

TEST_CASE("moe: routing weights are the renormalised selected scores times the scaling", "[nn][moe]") {
  const int64_t N = 7, D = 4, E = 6;
  Tensor x = randn({N, D}, DType::f64, 1), wr = randn({E, D}, DType::f64, 2);
  for (RouterScore score : {RouterScore::sigmoid, RouterScore::softmax})
    for (bool renorm : {true, false}) {
      MoeConfig c = small_moe(0);
      c.score = score;
      c.renormalize = renorm;
      Tensor bias = mul_scalar(randn({E}, DType::f32, 3), 0.3);
      Routing r = route(x, wr, bias, c);
      std::vector<double> logits = matmul(x, wr, false, true).to_vector(), w = r.weights.to_vector();
      CHECK(r.experts == select_experts(r.scores, bias, 2));
      for (int64_t n = 0; n < N; ++n) {
        std::vector<double> s(E);
        double z = 0;
        for (int64_t e = 0; e < E; ++e) z += std::exp(logits[n * E + e]);
        for (int64_t e = 0; e < E; ++e)
          s[e] = score == RouterScore::sigmoid ? 1 / (1 + std::exp(-logits[n * E + e])) : std::exp(logits[n * E + e]) / z;
        const double a = s[r.experts[n * 2]], b2 = s[r.experts[n * 2 + 1]];
        const double denom = renorm ? a + b2 + 1e-20 : 1.0;
        CHECK(w[n * 2] == Approx(1.7 * a / denom).epsilon(1e-13));
        CHECK(w[n * 2 + 1] == Approx(1.7 * b2 / denom).epsilon(1e-13));
      }
    }
}

TEST_CASE("moe: the router gradient matches finite differences through the selection", "[nn][moe]") {
  // A margin between the k-th and (k+1)-th biased score keeps the set fixed under
  // the finite-difference steps, so the check sees the smooth part (docs/model.md#moe-router).
  const int64_t N = 6, D = 5, E = 6;
  Tensor x = randn({N, D}, DType::f64, 11), wr = randn({E, D}, DType::f64, 12);
  Tensor bias = mul_scalar(randn({E}, DType::f32, 13), 0.1);
  for (RouterScore score : {RouterScore::sigmoid, RouterScore::softmax}) {
    MoeConfig c = small_moe(0);
    c.score = score;
    Routing r = route(x, wr, bias, c);
    std::vector<double> s = r.scores.to_vector(), b = bias.to(DType::f64).to_vector();
    for (int64_t n = 0; n < N; ++n) {
      std::vector<double> cs(E);
      for (int64_t e = 0; e < E; ++e) cs[e] = s[n * E + e] + b[e];
      std::sort(cs.rbegin(), cs.rend());
      REQUIRE(cs[1] - cs[2] > 1e-4);
    }
    check_gradients([&](const Tensors& in) { return route(in[0], in[1], bias, c).weights; }, {x, wr});
  }
}

TEST_CASE("moe: the expert plan sorts assignments by expert, stably, and drops over capacity", "[nn][moe]") {
  // 4 tokens x 2 slots: token-major expert ids.
  const std::vector<int64_t> experts = {2, 0, 0, 2, 2, 1, 0, 2};
  ExpertPlan p = plan_experts(experts, 4);
  CHECK(p.counts == std::vector<int64_t>{3, 1, 4, 0});
  CHECK(p.order == std::vector<int64_t>{1, 2, 6, 5, 0, 3, 4, 7});
  CHECK(p.dropped == 0);
  // Capacity 2: expert 0 keeps assignments 1, 2 (tokens 0, 1), expert 2 keeps 0, 3.
  ExpertPlan q = plan_experts(experts, 4, 2);
  CHECK(q.counts == std::vector<int64_t>{2, 1, 2, 0});
  CHECK(q.order == std::vector<int64_t>{1, 2, 5, 0, 3});
  CHECK(q.dropped == 3);
}

TEST_CASE("moe: the layer equals a per-token loop over the selected experts", "[nn][moe]") {
  for (int64_t latent : {int64_t{0}, int64_t{3}})
    for (FfnKind kind : {FfnKind::situ_glu, FfnKind::swiglu}) {
      INFO("latent " << latent << " kind " << ffn_kind_name(kind));
      const int64_t B = 2, T = 5, D = 4;
      MoeConfig c = small_moe(latent);
      ParamFactory f(true, DType::f64, 3);
      MoeLayer layer(c, D, expert_ffn(kind), 0.5, f, "mlp.");
      { NoGradGuard g; add_(layer.router.bias, mul_scalar(randn({6}, DType::f32, 9), 0.2)); }
      Tensor x = randn({B, T, D}, DType::f64, 4);
      Tensor y = layer.forward(x, false);
      Tensor xf = reshape(x, {B * T, D});
      Routing r = route(xf, layer.router.gate_weight, layer.router.bias, c);
      std::vector<double> w = r.weights.to_vector();
      const int64_t W = latent > 0 ? latent : D;
      auto expert = [&](int64_t e, const Tensor& z) {  // z [1, W]
        Tensor w1 = reshape(slice(layer.w1, 0, e, e + 1), {5, W}), w3 = reshape(slice(layer.w3, 0, e, e + 1), {5, W});
        Tensor w2 = reshape(slice(layer.w2, 0, e, e + 1), {W, 5});
        Tensor h = kind == FfnKind::situ_glu ? situ_glu(linear(z, w1), linear(z, w3), 4.0, 25.0)
                                             : mul(silu(linear(z, w1)), linear(z, w3));
        return linear(h, w2);
      };
      for (int64_t n = 0; n < B * T; ++n) {
        Tensor xn = slice(xf, 0, n, n + 1);
        Tensor z = latent > 0 ? linear(xn, layer.down_proj) : xn;
        Tensor acc = zeros({1, W}, DType::f64);
        for (int64_t j = 0; j < 2; ++j) acc = add(acc, mul_scalar(expert(r.experts[n * 2 + j], z), w[n * 2 + j]));
        if (latent > 0) acc = linear(rms_norm(acc, layer.latent_norm, 1e-5), layer.up_proj);
        acc = add(acc, layer.shared->forward(xn));
        CHECK(testing::max_abs_diff(acc, slice(reshape(y, {B * T, D}), 0, n, n + 1)) < 1e-13);
      }
    }
}

TEST_CASE("moe: every parameter gradient matches finite differences (f64), with aux and z losses", "[nn][moe]") {
  struct Case {
    int64_t latent;
    RouterScore score;
    FfnKind kind;
    double aux, z, capacity;
  };
  for (const Case& k : {Case{3, RouterScore::sigmoid, FfnKind::situ_glu, 0.1, 0.01, 0.0},
                        Case{0, RouterScore::softmax, FfnKind::swiglu, 0.0, 0.05, 0.0},
                        Case{3, RouterScore::sigmoid, FfnKind::situ_glu, 0.0, 0.0, 0.5}}) {
    INFO("latent " << k.latent << " capacity " << k.capacity);
    MoeConfig c = small_moe(k.latent);
    c.score = k.score;
    c.aux_loss_weight = k.aux;
    c.z_loss_weight = k.z;
    c.capacity_factor = k.capacity;
    ParamFactory f(true, DType::f64, 5);
    MoeLayer layer(c, 4, expert_ffn(k.kind), 0.5, f, "mlp.");
    Tensor x = randn({2, 5, 4}, DType::f64, 6), up = randn({2, 5, 4}, DType::f64, 7);
    x.set_requires_grad(true);
    ParameterList params = f.params();
    params.push_back({"x", x, false, "input"});
    auto loss = [&] {
      Tensor l = sum(mul(layer.forward(x, true), up));
      if (layer.aux_loss().defined()) l = add(l, layer.aux_loss());
      return l;
    };
    if (k.capacity > 0) {  // ceil(0.5 · 10 · 2 / 6) = 2 slots per expert: some are dropped
      layer.forward(x, true);
      CHECK(layer.stats().dropped > 0);
    }
    const testing::GradCheckResult r = testing::check_parameter_gradients(params, loss);
    INFO(r.worst);
    CHECK(r.max_rel_error < 1e-6);
  }
}

TEST_CASE("moe: aux-loss-free balancing drives a skewed router toward uniform load", "[nn][moe]") {
  // Experts 0 and 1 get a logit ~2 higher on most tokens; the bias update (γ = 0.003
  // per step here, 1e-3 in K3) must spread the load: max/mean from ~3 (two experts
  // take most tokens) to below 1.3 averaged over steps 301-400 (one batch of 256
  // tokens routed by a balanced router shows ~1.2: max of 8 counts of mean 64).
  // Without the update (γ = 0) the skew stays.
  auto run = [](double gamma) {
    MoeConfig c;
    c.num_experts = 8;
    c.top_k = 2;
    c.num_shared_experts = 0;
    c.expert_d_ff = 4;
    c.bias_update_rate = gamma;
    ParamFactory f(true, DType::f32, 1);
    MoeLayer layer(c, 8, expert_ffn(FfnKind::situ_glu), 0.5, f, "mlp.");
    NoGradGuard no_grad;
    float* w = layer.router.gate_weight.data<float>();
    w[0 * 8 + 0] += 2.0f;  // with x[:, 0] ≈ 1 below
    w[1 * 8 + 0] += 2.0f;
    Generator gen(3);
    double first = 0, late = 0;
    for (int step = 0; step < 400; ++step) {
      Tensor x = randn({4, 64, 8}, DType::f32, gen, 0.0, 1.0);
      float* px = x.data<float>();
      for (int64_t n = 0; n < 4 * 64; ++n) px[n * 8] += 1.0f;
      layer.forward(x, true);
      MoeStats& st = layer.stats();
      const double load = moe_load(st.tokens_per_expert).max_over_mean;
      if (step == 0) first = load;
      if (step >= 300) late += load / 100;
      layer.update_bias(st.tokens_per_expert);
      st.reset();
    }
    std::vector<double> b = layer.router.bias.to(DType::f64).to_vector();
    return std::make_tuple(first, late, std::accumulate(b.begin(), b.end(), 0.0));
  };
  auto [first, late, bias_sum] = run(0.003);
  auto [first0, late0, bias_sum0] = run(0.0);
  WARN("skewed router: max/mean load " << first << " at step 1, " << late << " over steps 301-400 (" << late0
                                       << " without the bias update)");
  CHECK(first > 2.5);
  CHECK(late < 1.3);
  CHECK(late0 > 2.5);
  CHECK(std::abs(bias_sum) < 1e-4);  // mean-centred updates
  CHECK(bias_sum0 == 0.0);
}

TEST_CASE("ParamFactory::make_rows gives each shard exactly the rows of the unsharded tensor", "[nn][moe]") {
  const Shape full_shape{7, 3, 5};
  std::vector<Init> inits = {Init::normal(0.5), Init::trunc_normal(0.02), Init::trunc_normal(1.0, -3, 3),
                             Init::constant(0.25),
                             Init::custom([](const Shape& s, DType d, Generator& g) { return rand(s, d, g); })};
  for (size_t k = 0; k < inits.size(); ++k) {
    // The parameters around the sharded one draw from the same generator: the
    // shard must also leave it where the unsharded construction does.
    ParamFactory whole(true, DType::f32, 11);
    Tensor before = whole.make("a", {4}, Init::normal(1.0), "g", true);
    Tensor all = whole.make("w", full_shape, inits[k], "g", true);
    Tensor after = whole.make("b", {6}, Init::normal(1.0), "g", true);
    for (auto [lo, hi] : {std::pair<int64_t, int64_t>{0, 2}, {2, 5}, {5, 7}, {3, 4}}) {
      INFO("init " << k << " rows [" << lo << ", " << hi << ")");
      ParamFactory part(true, DType::f32, 11);
      Tensor p_before = part.make("a", {4}, Init::normal(1.0), "g", true);
      Tensor rows = part.make_rows("w", full_shape, lo, hi, inits[k], "g", true);
      Tensor p_after = part.make("b", {6}, Init::normal(1.0), "g", true);
      REQUIRE(rows.shape() == Shape({hi - lo, 3, 5}));
      const float* want = all.data<float>() + lo * 15;
      for (int64_t i = 0; i < rows.numel(); ++i) REQUIRE(rows.data<float>()[i] == want[i]);
      for (int64_t i = 0; i < 6; ++i) REQUIRE(p_after.data<float>()[i] == after.data<float>()[i]);
      REQUIRE(part.specs()[1].shape == Shape({hi - lo, 3, 5}));
    }
  }
}
