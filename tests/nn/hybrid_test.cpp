#include <algorithm>
#include <cmath>
#include <map>

#include <catch2/catch.hpp>

#include "moetrain.h"
#include "nn/fixtures.h"
#include "nn/hybrid.h"
#include "nn/kda_layer.h"
#include "testing.h"

using namespace moetrain;
using moetrain::testing::max_abs_diff;

namespace {

using testing::random_ids;
using testing::tiny_hybrid;

// AttnRes pseudo-queries start at zero and the softplus gate at its fla init; move
// every parameter off its init so no gradient is trivially zero.
void perturb(HybridModel& m, uint64_t seed) {
  NoGradGuard no_grad;
  for (NamedParameter& p : m.parameters()) add_(p.tensor, randn(p.tensor.shape(), p.tensor.dtype(), seed++), 0.1);
}

}  // namespace

TEST_CASE("hybrid: K3's mixer schedule (MLA at l % 4 == 3 and the last layer)", "[nn][hybrid]") {
  std::vector<MixerKind> k3 = mixer_schedule(93, "", MixerKind::kda, MixerKind::mla, 4, 3, true);
  int mla = 0;
  for (size_t l = 0; l < k3.size(); ++l) {
    bool expect = l % 4 == 3 || l == 92;
    CHECK((k3[l] == MixerKind::mla) == expect);
    mla += k3[l] == MixerKind::mla;
  }
  CHECK(mla == 24);
  std::vector<MixerKind> tiny9 = mixer_schedule(9, "", MixerKind::kda, MixerKind::mla, 4, 3, true);
  for (size_t l = 0; l < 9; ++l) CHECK((tiny9[l] == MixerKind::mla) == (l == 3 || l == 7 || l == 8));
  std::vector<MixerKind> list = mixer_schedule(3, "kda, attention,mla", MixerKind::kda, MixerKind::mla, 4, 3, true);
  CHECK((list == std::vector<MixerKind>{MixerKind::kda, MixerKind::attention, MixerKind::mla}));
  CHECK_THROWS_WITH(mixer_schedule(2, "kda,mla,kda", MixerKind::kda, MixerKind::mla, 4, 3, true),
                    Catch::Contains("names 3 layers but n_layer is 2"));
  CHECK_THROWS_WITH(mixer_schedule(1, "gru", MixerKind::kda, MixerKind::mla, 4, 3, true),
                    Catch::Contains("unknown mixer 'gru'"));
}

TEST_CASE("hybrid: every parameter gradient matches finite differences (f64)", "[nn][hybrid]") {
  for (bool attn_res : {true, false}) {
    INFO("attn_res " << attn_res);
    HybridModel model(tiny_hybrid(DType::f64, attn_res), 7);
    perturb(model, 100);
    Tensor ids = random_ids(2, 6, 23, 1), targets = random_ids(2, 6, 23, 2);
    const testing::GradCheckResult r =
        testing::check_parameter_gradients(model.parameters(), [&] { return model.loss(ids, targets); });
    INFO(r.worst);
    CHECK(r.max_rel_error < 1e-5);
  }
}

TEST_CASE("hybrid: decoding with caches gives the logits of the full forward", "[nn][hybrid]") {
  for (bool chunked : {true, false}) {
    INFO("chunked " << chunked);
    HybridModel model(tiny_hybrid(DType::f64, true, chunked), 3);
    perturb(model, 200);
    Tensor ids = random_ids(2, 11, 23, 4);
    Tensor full_logits;
    {
      NoGradGuard no_grad;
      full_logits = model.forward(ids, false);
    }
    std::unique_ptr<DecodeCache> cache = model.new_cache();
    Tensors parts{model.forward_cached(slice(ids, 1, 0, 5), *cache)};  // prefill crosses a KDA chunk
    for (int64_t t = 5; t < 11; ++t) parts.push_back(model.forward_cached(slice(ids, 1, t, t + 1), *cache));
    Tensor cached = concat(parts, 1);
    double scale = 0;
    for (double v : full_logits.to_vector()) scale = std::max(scale, std::abs(v));
    CHECK(max_abs_diff(cached, full_logits) <= 1e-10 * scale);
    CHECK(cache->length() == 11);
  }
}

TEST_CASE("hybrid: decoding caches: KDA constant, MLA and attention linear in length", "[nn][hybrid]") {
  HybridConfig c = tiny_hybrid(DType::f32);
  c.mixers = {MixerKind::kda, MixerKind::kda};
  HybridModel kda_only(c, 1);
  c.mixers = {MixerKind::mla, MixerKind::attention};
  HybridModel attn_only(c, 1);
  auto bytes_after = [](HybridModel& m, int64_t n) {
    std::unique_ptr<DecodeCache> cache = m.new_cache();
    for (int64_t t = 0; t < n; ++t) m.forward_cached(random_ids(1, 1, 23, static_cast<uint64_t>(t)), *cache);
    return cache->bytes();
  };
  CHECK(bytes_after(kda_only, 3) == bytes_after(kda_only, 9));
  // MLA: (kv_lora_rank + rope dim) per token; attention: 2 D per token (f32).
  CHECK(bytes_after(attn_only, 9) - bytes_after(attn_only, 3) == 6 * (4 + 2 + 2 * 12) * 4);
}

TEST_CASE("hybrid: f32 agrees with f64", "[nn][hybrid]") {
  HybridModel m64(tiny_hybrid(DType::f64), 5), m32(tiny_hybrid(DType::f32), 5);
  Tensor ids = random_ids(2, 9, 23, 6), targets = random_ids(2, 9, 23, 7);
  NoGradGuard no_grad;
  double l64 = m64.loss(ids, targets).item<double>(), l32 = m32.loss(ids, targets).item<double>();
  CHECK(std::abs(l64 - l32) < 1e-5 * std::abs(l64));
}

TEST_CASE("hybrid: the docs/model.md#shipped-configs family counts come from the construction code (shapes only)", "[nn][hybrid]") {
  // k3-tiny and k3-small of docs/model.md#shipped-configs (total parameters, router bias not counted).
  auto family = [](int64_t V, int64_t D, int64_t L, int64_t kh, int64_t kd, int64_t mh, int64_t rq, int64_t rkv,
                   int64_t dn, int64_t dr, int64_t dv, int64_t F, int64_t E, int64_t k, int64_t lat, int64_t ef,
                   int64_t S) {
    HybridConfig c;
    c.vocab_size = V;
    c.d_model = D;
    c.mixers = mixer_schedule(L, "", MixerKind::kda, MixerKind::mla, 4, 3, true);
    c.kda.n_head = kh;
    c.kda.head_dim = kd;
    c.mla.n_head = mh;
    c.mla.q_lora_rank = rq;
    c.mla.kv_lora_rank = rkv;
    c.mla.qk_nope_head_dim = dn;
    c.mla.qk_rope_head_dim = dr;
    c.mla.v_head_dim = dv;
    c.ffn.d_ff = F;
    c.moe.num_experts = E;
    c.moe.top_k = k;
    c.moe.num_shared_experts = 2;
    c.moe.expert_d_ff = ef;
    c.moe.latent_dim = lat;
    c.attn_res_block_size = S;
    HybridModel m(c, 0, /*allocate=*/false);
    int64_t n = 0;
    for (const ParamSpec& s : m.param_specs()) n += s.shape.numel();
    CHECK(m.parameters().empty());
    return n;
  };
  CHECK(family(256, 64, 9, 2, 32, 2, 32, 32, 32, 16, 32, 192, 16, 4, 32, 32, 4) == 820940);
  CHECK(family(50304, 256, 13, 4, 64, 4, 128, 64, 64, 32, 64, 1152, 64, 8, 128, 112, 4) == 67105636);
}

TEST_CASE("hybrid: the lower-bound gate's initial decays (model.kda.dt_bias_init)", "[nn][hybrid]") {
  // At f = 0 the gate is g = lb·σ(e^{A_log}·dt_bias): spread puts every channel at
  // g = −dt with dt in [1e-3, 1e-1], spread over the range; zero (TT-K3) puts every
  // channel at lb/2.
  KdaLayerConfig c;
  c.d_model = 8;
  c.n_head = 4;
  c.n_value_head = 8;
  c.head_dim = 64;
  const auto initial_decays = [&](KdaDtBiasInit init, double lower_bound) {
    c.dt_bias_init = init;
    c.lower_bound = lower_bound;
    ParamFactory f(true, DType::f64, 7);
    KdaLayer layer(c, f, "l.");
    return kda_gate(zeros({8, 64}, DType::f64), layer.A_log, layer.dt_bias, KdaGate::lower_bound, lower_bound)
        .to_vector();
  };
  for (double lb : {-5.0, -1.0}) {
    const std::vector<double> g = initial_decays(KdaDtBiasInit::spread, lb);
    const auto [lo, hi] = std::minmax_element(g.begin(), g.end());
    CHECK(*lo >= -0.1 * (1 + 1e-12));
    CHECK(*hi <= -1e-3 * (1 - 1e-12));
    CHECK(*lo < -0.05);   // log-uniform over two decades: both ends are reached
    CHECK(*hi > -0.002);  // among 512 channels
    int below_1e2 = 0;    // half of log U(1e-3, 1e-1) lies below 1e-2
    for (double v : g) below_1e2 += v > -1e-2;
    CHECK(std::abs(below_1e2 / 512.0 - 0.5) < 0.1);
  }
  for (double v : initial_decays(KdaDtBiasInit::zero, -5.0)) CHECK(v == -2.5);
  // The cap dt/|lb| ≤ 1/2 keeps a tiny bound finite: g = lb/2 for every dt ≥ |lb|/2
  // (P(dt > 0.005) = log(20)/log(100) ≈ 0.65), g = −dt below.
  int capped = 0;
  for (double v : initial_decays(KdaDtBiasInit::spread, -0.01)) {
    CHECK(v >= -0.005 * (1 + 1e-12));
    CHECK(v <= -1e-3 * (1 - 1e-12));
    capped += std::abs(v + 0.005) < 1e-12;
  }
  CHECK(std::abs(capped / 512.0 - 0.65) < 0.1);
}

// ---------------------------------------------------------------------------------------------------
// The evolution ladder's mixers (docs/evolution.md): linear attention, DeltaNet, Gated DeltaNet.

namespace {

HybridConfig ladder(DType dtype, bool attn_res, bool chunked) {
  HybridConfig c = tiny_hybrid(dtype, attn_res, chunked);
  c.mixers = {MixerKind::linear_attention, MixerKind::deltanet, MixerKind::gated_deltanet, MixerKind::kda,
              MixerKind::linear_attention};
  c.kda.n_value_head = 0;  // linear attention has one value head per head; the delta rules keep GVA below
  c.moe.num_experts = 0;
  return c;
}

}  // namespace

TEST_CASE("hybrid: the ladder's mixers have their own parameters", "[nn][hybrid][evolution]") {
  HybridConfig c = ladder(DType::f32, false, true);
  c.kda.n_value_head = 4;  // GVA for the delta rules
  c.mixers = {MixerKind::linear_attention, MixerKind::deltanet, MixerKind::gated_deltanet};
  HybridModel m(c, 1);
  std::map<std::string, Shape> shapes;
  for (const NamedParameter& p : m.parameters()) shapes[p.name] = p.tensor.shape();
  auto has = [&](const std::string& name) { return shapes.count(name) > 0; };
  // linear attention: q, k, v, o only (12 = d_model, 6 = H·K).
  CHECK(shapes["model.layers.0.self_attn.q_proj.weight"] == Shape({6, 12}));
  CHECK(shapes["model.layers.0.self_attn.o_proj.weight"] == Shape({12, 6}));
  CHECK_FALSE(has("model.layers.0.self_attn.b_proj.weight"));
  CHECK_FALSE(has("model.layers.0.self_attn.q_conv1d.weight"));
  // DeltaNet: no decay parameters.
  CHECK(has("model.layers.1.self_attn.b_proj.weight"));
  for (const char* n : {"f_a_proj.weight", "f_b_proj.weight", "a_proj.weight", "A_log", "dt_bias"})
    CHECK_FALSE(has(std::string("model.layers.1.self_attn.") + n));
  // Gated DeltaNet: one decay per value head (HV = 4).
  CHECK(shapes["model.layers.2.self_attn.a_proj.weight"] == Shape({4, 12}));
  CHECK(shapes["model.layers.2.self_attn.A_log"] == Shape({4}));
  CHECK(shapes["model.layers.2.self_attn.dt_bias"] == Shape({4}));
  CHECK_FALSE(has("model.layers.2.self_attn.f_a_proj.weight"));
  CHECK_THAT(m.describe(), Catch::Contains("1 deltanet, 1 gated_deltanet, 1 linear_attention"));
  for (MixerKind k : {MixerKind::linear_attention, MixerKind::deltanet, MixerKind::gated_deltanet})
    CHECK(parse_mixer_kind(mixer_kind_name(k)) == k);
}

TEST_CASE("hybrid: the ladder's mixers: every parameter gradient matches finite differences (f64)",
          "[nn][hybrid][evolution]") {
  // Chunked kernels with AttnRes; the recurrent kernels' gradients are checked per op
  // (tests/ops) and their forward against the chunked one below.
  {
    HybridModel model(ladder(DType::f64, true, true), 9);
    perturb(model, 300);
    Tensor ids = random_ids(2, 6, 23, 5), targets = random_ids(2, 6, 23, 6);
    const testing::GradCheckResult r =
        testing::check_parameter_gradients(model.parameters(), [&] { return model.loss(ids, targets); });
    INFO(r.worst);
    CHECK(r.max_rel_error < 1e-5);
  }
}

TEST_CASE("hybrid: the ladder's mixers: chunked equals recurrent, decoding equals the full forward",
          "[nn][hybrid][evolution]") {
  Tensor ids = random_ids(2, 11, 23, 7);
  Tensor reference;  // recurrent kernels, full forward
  for (bool chunked : {false, true}) {
    INFO("chunked " << chunked);
    HybridModel model(ladder(DType::f64, true, chunked), 3);
    perturb(model, 400);
    Tensor full_logits;
    {
      NoGradGuard no_grad;
      full_logits = model.forward(ids, false);
    }
    double scale = 0;
    for (double v : full_logits.to_vector()) scale = std::max(scale, std::abs(v));
    if (!reference.defined()) reference = full_logits;
    CHECK(max_abs_diff(full_logits, reference) <= 1e-10 * scale);
    std::unique_ptr<DecodeCache> cache = model.new_cache();
    Tensors parts{model.forward_cached(slice(ids, 1, 0, 5), *cache)};  // prefill crosses a chunk (4)
    for (int64_t t = 5; t < 11; ++t) parts.push_back(model.forward_cached(slice(ids, 1, t, t + 1), *cache));
    CHECK(max_abs_diff(concat(parts, 1), full_logits) <= 1e-10 * scale);
  }
}

TEST_CASE("hybrid: decode_cache_bytes is what the cache holds", "[nn][hybrid][evolution]") {
  for (bool use_ladder : {false, true}) {
    INFO("ladder " << use_ladder);
    HybridConfig c = use_ladder ? ladder(DType::f32, true, true) : tiny_hybrid(DType::f32);
    HybridModel m(c, 1);
    for (int64_t n : {1, 6}) {
      std::unique_ptr<DecodeCache> cache = m.new_cache();
      m.forward_cached(random_ids(1, n - 1 > 0 ? n - 1 : 1, 23, 8), *cache);
      if (n > 1) m.forward_cached(random_ids(1, 1, 23, 9), *cache);
      REQUIRE(cache->length() == n);
      CHECK(m.decode_cache_bytes(n) == cache->bytes());
    }
  }
}

TEST_CASE("hybrid: under mixed precision the routers and KDA's A_log, dt_bias, convs and output norm stay f32",
          "[nn][hybrid][bf16]") {
  HybridModel model(tiny_hybrid(DType::f32), 1);
  std::map<std::string, bool> stays;
  for (const NamedParameter& p : model.parameters()) stays[p.name] = stays_f32_in_mixed_precision(p);
  for (const char* name : {"model.layers.0.self_attn.A_log", "model.layers.0.self_attn.dt_bias",
                           "model.layers.0.self_attn.q_conv1d.weight", "model.layers.0.self_attn.v_conv1d.weight",
                           "model.layers.4.self_attn.o_norm.weight", "model.layers.2.mlp.gate.weight"}) {
    INFO(name);
    REQUIRE(stays.count(name) == 1);
    CHECK(stays[name]);
  }
  for (const char* name : {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight",
                           "model.layers.0.input_layernorm.weight", "model.embed_tokens.weight"}) {
    INFO(name);
    REQUIRE(stays.count(name) == 1);
    CHECK(!stays[name]);
  }
  // Three KDA layers with 6 such parameters each (A_log, dt_bias, 3 convs, o_norm), three routers.
  CHECK(std::count_if(stays.begin(), stays.end(), [](const auto& e) { return e.second; }) == 3 * 6 + 3);
}
