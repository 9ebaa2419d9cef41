// The models' QK-Clip sites (nn/language_model.h, docs/model.md#qk-clip): which
// layers have one, the parameter names they give, and the max logit a training
// forward records, against q and k recomputed here from the model's own weights
// (through the ops) and a direct f64 max over the causal scores.
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <map>
#include <set>
#include <string>

#include "config/config.h"
#include "fixtures.h"
#include "moetrain.h"
#include "nn/gpt2.h"
#include "nn/hybrid.h"
#include "nn/mla.h"
#include "testing.h"

using namespace moetrain;
using moetrain::testing::random_ids;
using moetrain::testing::tiny_gpt2;
using moetrain::testing::tiny_hybrid;

namespace {

// Per head: max over b, t, s <= t of scale q[b,t,h]·k[b,s,h] (q, k [B, T, H, d]).
std::vector<double> direct_max_logits(const Tensor& q, const Tensor& k, double scale) {
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), D = q.size(3);
  const std::vector<double> vq = q.contiguous().to_vector(), vk = k.contiguous().to_vector();
  std::vector<double> out(static_cast<size_t>(H), -std::numeric_limits<double>::infinity());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t s = 0; s <= t; ++s) {
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += vq[((b * T + t) * H + h) * D + d] * vk[((b * T + s) * H + h) * D + d];
          out[static_cast<size_t>(h)] = std::max(out[static_cast<size_t>(h)], dot * scale);
        }
  return out;
}

Tensor param_named(LanguageModel& model, const std::string& name) {
  for (const NamedParameter& p : model.parameters())
    if (p.name == name) return p.tensor.detach();
  FAIL("no parameter " << name);
  return {};
}

// A site's max logit as doubles; empty when undefined.
std::vector<double> site_max_logits(const QkClipSite* site) {
  return site->max_logit.defined() ? site->max_logit.to(kCpu).to_vector() : std::vector<double>{};
}

void check_site_max_close(const std::vector<double>& got, const std::vector<double>& expected) {
  REQUIRE(got.size() == expected.size());
  // The kernel's scores are BLAS dot products (another summation order than the
  // direct loop's) of the same f64 q and k: 1e-12 relative.
  for (size_t h = 0; h < got.size(); ++h) CHECK(got[h] == Approx(expected[h]).epsilon(1e-12).margin(1e-12));
}

// GPT-2's blocks by hand: each block's q and k from LN_1(x) and c_attn, the block
// itself (gpt2_block, dropout 0) to reach the next one's input.
std::vector<std::vector<double>> gpt2_by_hand(Gpt2& model, const Tensor& ids) {
  NoGradGuard no_grad;
  const Gpt2Config& c = model.config();
  const int64_t B = ids.size(0), T = ids.size(1), D = c.d_model, H = c.n_head, hd = D / H;
  Tensor x = add(embedding(param_named(model, "wte.weight"), ids), slice(param_named(model, "wpe.weight"), 0, 0, T));
  std::vector<std::vector<double>> out;
  for (int64_t l = 0; l < c.n_layer; ++l) {
    const std::string p = "h." + std::to_string(l) + ".";
    auto w = [&](const std::string& name) { return param_named(model, p + name); };
    Gpt2BlockWeights b{w("ln_1.weight"), w("ln_1.bias"), w("attn.c_attn.weight"), w("attn.c_attn.bias"),
                       w("attn.c_proj.weight"), w("attn.c_proj.bias"), w("ln_2.weight"), w("ln_2.bias"),
                       w("mlp.c_fc.weight"), w("mlp.c_fc.bias"), w("mlp.c_proj.weight"), w("mlp.c_proj.bias")};
    Tensor qkv = linear(layer_norm(x, b.ln1_w, b.ln1_b, c.layer_norm_eps), b.attn_w, b.attn_b);
    Tensor q = reshape(slice(qkv, 2, 0, D).contiguous(), {B, T, H, hd});
    Tensor k = reshape(slice(qkv, 2, D, 2 * D).contiguous(), {B, T, H, hd});
    out.push_back(direct_max_logits(q, k, 1.0 / std::sqrt(static_cast<double>(hd))));
    x = gpt2_block(b, x, H, c.layer_norm_eps, 0.0);
  }
  return out;
}

// q and k of hybrid layer l's softmax-attention mixer from its normed input,
// through the ops and the stage's weights (prefix model.layers.<l>.self_attn.).
std::vector<double> hybrid_layer_by_hand(HybridModel& stage, int64_t l, const Tensor& normed) {
  NoGradGuard no_grad;
  const HybridConfig& c = stage.config();
  const std::string p = "model.layers." + std::to_string(l) + ".self_attn.";
  auto w = [&](const std::string& name) { return param_named(stage, p + name); };
  const int64_t B = normed.size(0), T = normed.size(1);
  if (c.mixers[static_cast<size_t>(l)] == MixerKind::attention) {
    const int64_t H = c.attention_n_head, hd = c.d_model / H;
    Tensor q = reshape(linear(normed, w("q_proj.weight")), {B, T, H, hd});
    Tensor k = reshape(linear(normed, w("k_proj.weight")), {B, T, H, hd});
    return direct_max_logits(q, k, 1.0 / std::sqrt(static_cast<double>(hd)));
  }
  const MlaConfig& m = c.mla;
  const int64_t H = m.n_head, dn = m.qk_nope_head_dim, dr = m.qk_rope_head_dim, dv = m.v_head_dim;
  Tensor q = m.q_lora_rank > 0 ? linear(rms_norm(linear(normed, w("q_a_proj.weight")), w("q_a_layernorm.weight"),
                                                 m.lora_norm_eps),
                                        w("q_b_proj.weight"))
                               : linear(normed, w("q_proj.weight"));
  q = reshape(q, {B, T, H, dn + dr});
  Tensor ckr = linear(normed, w("kv_a_proj_with_mqa.weight"));  // [B, T, r_kv + dr]
  Tensor latent = rms_norm(slice(ckr, 2, 0, m.kv_lora_rank).contiguous(), w("kv_a_layernorm.weight"), m.lora_norm_eps);
  Tensor kr = slice(ckr, 2, m.kv_lora_rank, m.kv_lora_rank + dr).contiguous();  // [B, T, dr], shared by the heads
  Tensor kv = reshape(linear(latent, w("kv_b_proj.weight")), {B, T, H, dn + dv});
  Tensor k_rot = broadcast_to(reshape(kr, {B, T, 1, dr}), Shape{B, T, H, dr});
  Tensor k = concat({slice(kv, 3, 0, dn).contiguous(), k_rot}, 3);
  return direct_max_logits(q, k, 1.0 / std::sqrt(static_cast<double>(dn + dr)));
}

// Every name a site gives is a parameter of the model, with the shape its layout needs.
void check_site_names(const std::vector<QkClipSite*>& sites, const std::map<std::string, Shape>& shapes) {
  for (const QkClipSite* s : sites) {
    INFO("site " << s->layer << " q " << s->q_weight << " k " << s->k_weight);
    REQUIRE(shapes.count(s->q_weight));
    REQUIRE(s->n_head >= 1);
    const Shape& q = shapes.at(s->q_weight);
    switch (s->layout) {
      case QkClipSite::Layout::fused_qkv: {
        CHECK(s->k_weight.empty());
        CHECK(q[0] == 3 * q[1]);
        CHECK(q[1] % s->n_head == 0);
        if (!s->q_bias.empty()) CHECK(shapes.at(s->q_bias) == Shape{q[0]});
        break;
      }
      case QkClipSite::Layout::separate_qk: {
        REQUIRE(shapes.count(s->k_weight));
        CHECK(q[0] % s->n_head == 0);
        CHECK(shapes.at(s->k_weight)[0] == q[0]);
        CHECK(s->q_bias.empty());
        CHECK(s->k_bias.empty());
        break;
      }
      case QkClipSite::Layout::mla: {
        REQUIRE(shapes.count(s->k_weight));
        const MlaHeadDims& d = s->mla;
        CHECK(d.n_head == s->n_head);
        CHECK(q[0] == d.n_head * (d.qk_nope_head_dim + d.qk_rope_head_dim));
        CHECK(shapes.at(s->k_weight)[0] == d.n_head * (d.qk_nope_head_dim + d.v_head_dim));
        CHECK((s->q_weight.find("q_b_proj.weight") != std::string::npos ||
               s->q_weight.find("q_proj.weight") != std::string::npos));
        CHECK(s->k_weight.find("kv_b_proj.weight") != std::string::npos);
        break;
      }
    }
  }
}

std::map<std::string, Shape> shapes_of(const ParameterList& params) {
  std::map<std::string, Shape> out;
  for (const NamedParameter& p : params) out[p.name] = p.tensor.shape();
  return out;
}

std::map<std::string, Shape> shapes_of(const std::vector<ParamSpec>& specs) {
  std::map<std::string, Shape> out;
  for (const ParamSpec& s : specs) out[s.name] = s.shape;
  return out;
}

}  // namespace

TEST_CASE("qk_clip sites: GPT-2 records each block's max logit in training forwards only", "[nn][qk_clip]") {
  for (bool checkpointing : {false, true}) {
    DYNAMIC_SECTION("activation_checkpointing=" << checkpointing) {
      Gpt2Config c = tiny_gpt2();
      c.activation_checkpointing = checkpointing;
      Gpt2 model(c, 11);
      const Tensor ids = random_ids(2, 9, c.vocab_size, 1), targets = random_ids(2, 9, c.vocab_size, 2);
      const std::vector<QkClipSite*> sites = model.qk_clip_sites();
      REQUIRE(sites.size() == static_cast<size_t>(c.n_layer));
      check_site_names(sites, shapes_of(model.parameters()));
      for (size_t l = 0; l < sites.size(); ++l) {
        CHECK(sites[l]->layout == QkClipSite::Layout::fused_qkv);
        CHECK(sites[l]->q_weight == "h." + std::to_string(l) + ".attn.c_attn.weight");
        CHECK(sites[l]->q_bias == "h." + std::to_string(l) + ".attn.c_attn.bias");
        CHECK(sites[l]->layer == "layers." + std::to_string(l));
        CHECK(sites[l]->n_head == c.n_head);
      }

      // Tracking off: nothing recorded.
      model.loss(ids, targets).backward();
      for (const QkClipSite* s : sites) CHECK_FALSE(s->max_logit.defined());

      model.set_track_max_logits(true);
      {  // evaluation and generation run without grad: nothing recorded
        NoGradGuard no_grad;
        model.loss(ids, targets, false);
      }
      auto cache = model.new_cache();
      model.forward_cached(ids, *cache);
      for (const QkClipSite* s : sites) CHECK_FALSE(s->max_logit.defined());

      // A training forward (checkpointed: the blocks run without grad inside, so
      // the decision is the forward's): each block's max, before and after backward.
      Tensor loss = model.loss(ids, targets);
      const std::vector<std::vector<double>> expected = gpt2_by_hand(model, ids);
      for (size_t l = 0; l < sites.size(); ++l) {
        INFO("layer " << l);
        CHECK(sites[l]->max_logit.dtype() == DType::f64);
        CHECK_FALSE(sites[l]->max_logit.requires_grad());
        check_site_max_close(site_max_logits(sites[l]), expected[l]);
      }
      loss.backward();  // the checkpointed recomputation folds the same values
      for (size_t l = 0; l < sites.size(); ++l) check_site_max_close(site_max_logits(sites[l]), expected[l]);

      model.reset_max_logits();
      for (const QkClipSite* s : sites) CHECK_FALSE(s->max_logit.defined());
      model.set_track_max_logits(false);
      model.loss(ids, targets);
      for (const QkClipSite* s : sites) CHECK_FALSE(s->max_logit.defined());
    }
  }
}

TEST_CASE("qk_clip sites: two forwards fold the per-head max", "[nn][qk_clip]") {
  Gpt2 model(tiny_gpt2(), 12);
  model.set_track_max_logits(true);
  const Tensor a = random_ids(2, 7, 37, 3), b = random_ids(1, 12, 37, 4), targets_a = random_ids(2, 7, 37, 5),
               targets_b = random_ids(1, 12, 37, 6);
  auto run = [&](const std::vector<std::pair<Tensor, Tensor>>& batches) {
    model.reset_max_logits();
    for (const auto& [ids, targets] : batches) model.loss(ids, targets);
    std::vector<std::vector<double>> out;
    for (const QkClipSite* s : model.qk_clip_sites()) out.push_back(site_max_logits(s));
    return out;
  };
  const auto only_a = run({{a, targets_a}}), only_b = run({{b, targets_b}});
  const auto both = run({{a, targets_a}, {b, targets_b}});
  bool a_wins = false, b_wins = false;  // the batches must each hold some head's max, or the test shows nothing
  for (size_t l = 0; l < both.size(); ++l)
    for (size_t h = 0; h < both[l].size(); ++h) {
      CHECK(both[l][h] == std::max(only_a[l][h], only_b[l][h]));  // a max of the same values: exact
      a_wins |= only_a[l][h] > only_b[l][h];
      b_wins |= only_b[l][h] > only_a[l][h];
    }
  CHECK(a_wins);
  CHECK(b_wins);
}

TEST_CASE("qk_clip sites: hybrid MLA and attention layers record the max logit of their own q and k",
          "[nn][qk_clip]") {
  for (bool lora : {true, false}) {
    DYNAMIC_SECTION("q_lora_rank " << (lora ? "5" : "0")) {
      HybridConfig c = tiny_hybrid(DType::f64, /*attn_res=*/false);  // the stage boundary is the residual stream
      if (!lora) c.mla.q_lora_rank = 0;
      const int64_t L = c.n_layer();
      HybridModel whole(c, 21);
      const std::vector<QkClipSite*> sites = whole.qk_clip_sites();
      REQUIRE(sites.size() == 2);  // kda, mla, kda, attention, kda
      CHECK(sites[0]->layer == "layers.1");
      CHECK(sites[0]->layout == QkClipSite::Layout::mla);
      CHECK(sites[0]->q_weight ==
            std::string("model.layers.1.self_attn.") + (lora ? "q_b_proj.weight" : "q_proj.weight"));
      CHECK(sites[0]->k_weight == "model.layers.1.self_attn.kv_b_proj.weight");
      CHECK(sites[0]->mla.qk_nope_head_dim == c.mla.qk_nope_head_dim);
      CHECK(sites[0]->mla.qk_rope_head_dim == c.mla.qk_rope_head_dim);
      CHECK(sites[0]->mla.v_head_dim == c.mla.v_head_dim);
      CHECK(sites[1]->layer == "layers.3");
      CHECK(sites[1]->layout == QkClipSite::Layout::separate_qk);
      CHECK(sites[1]->q_weight == "model.layers.3.self_attn.q_proj.weight");
      CHECK(sites[1]->k_weight == "model.layers.3.self_attn.k_proj.weight");
      CHECK(sites[1]->n_head == c.attention_n_head);
      check_site_names(sites, shapes_of(whole.parameters()));

      const Tensor ids = random_ids(2, 10, c.vocab_size, 7), targets = random_ids(2, 10, c.vocab_size, 8);
      whole.loss(ids, targets);  // tracking off
      for (const QkClipSite* s : sites) CHECK_FALSE(s->max_logit.defined());
      {
        whole.set_track_max_logits(true);
        NoGradGuard no_grad;
        whole.loss(ids, targets, false);
        auto cache = whole.new_cache();
        whole.forward_cached(ids, *cache);
      }
      for (const QkClipSite* s : sites) CHECK_FALSE(s->max_logit.defined());
      whole.loss(ids, targets).backward();

      // Each layer's input from one-layer pipeline stages of the same seed; each
      // stage has its own layer's site (labelled with the whole model's index).
      Tensors state;
      for (int64_t l = 0; l < L; ++l) {
        INFO("layer " << l);
        HybridModel stage(c, 21, true, {}, PipelineStage{l, L});
        stage.set_track_max_logits(true);
        const std::vector<QkClipSite*> own = stage.qk_clip_sites();
        check_site_names(own, shapes_of(stage.parameters()));
        const MixerKind kind = c.mixers[static_cast<size_t>(l)];
        const bool softmax = kind == MixerKind::mla || kind == MixerKind::attention;
        REQUIRE(own.size() == (softmax ? 1u : 0u));
        StageOutput out = stage.stage_forward(ids, state, l == L - 1 ? targets : Tensor(), true);
        if (softmax) {
          CHECK(own[0]->layer == "layers." + std::to_string(l));
          const Tensor normed = rms_norm(state[0].detach(),
                                         param_named(stage, "model.layers." + std::to_string(l) +
                                                                ".input_layernorm.weight"),
                                         c.rms_norm_eps);
          const std::vector<double> expected = hybrid_layer_by_hand(stage, l, normed);
          check_site_max_close(site_max_logits(own[0]), expected);
          check_site_max_close(site_max_logits(sites[kind == MixerKind::mla ? 0 : 1]), expected);
        }
        state.clear();
        for (const Tensor& t : out.activations) state.push_back(t.detach());
      }
      whole.reset_max_logits();
      for (const QkClipSite* s : sites) CHECK_FALSE(s->max_logit.defined());
    }
  }
}

TEST_CASE("qk_clip sites: every shipped config's sites name its parameters", "[nn][qk_clip]") {
  const std::vector<std::string> configs = {
      "gpt2-shakespeare", "gpt2-small", "k3-base", "k3-scaled-lite", "k3-scaled", "k3-shakespeare", "k3-small",
      "k3-tiny", "k3-topology-mini", "kimi-k3", "evolution/01-gpt2", "evolution/02-linear-attention",
      "evolution/03-deltanet", "evolution/04-gated-deltanet", "evolution/05-kda", "evolution/06-kimi-linear",
      "evolution/07-k3"};
  for (const std::string& name : configs) {
    DYNAMIC_SECTION(name) {
      const Config config = Config::load(std::string(MOETRAIN_SOURCE_DIR) + "/configs/" + name + ".yaml");
      if (config.get_string("model.arch") == "hybrid") {
        const HybridConfig hc = HybridConfig::from(config);
        HybridModel model(hc, 0, /*allocate=*/false);  // shapes only
        std::set<int64_t> softmax_layers;
        for (int64_t l = 0; l < hc.n_layer(); ++l)
          if (hc.mixers[static_cast<size_t>(l)] == MixerKind::mla ||
              hc.mixers[static_cast<size_t>(l)] == MixerKind::attention)
            softmax_layers.insert(l);
        std::set<int64_t> site_layers;
        for (const QkClipSite* s : model.qk_clip_sites()) site_layers.insert(std::stoll(s->layer.substr(7)));
        CHECK(site_layers == softmax_layers);
        check_site_names(model.qk_clip_sites(), shapes_of(model.param_specs()));
      } else {
        Gpt2 model(Gpt2Config::from(config), 0, /*allocate=*/false);
        CHECK(model.qk_clip_sites().size() == static_cast<size_t>(model.config().n_layer));
        check_site_names(model.qk_clip_sites(), shapes_of(model.param_specs()));
      }
    }
  }
}

TEST_CASE("qk_clip sites: hybrid pipeline stages hold the sites of their own layers", "[nn][qk_clip]") {
  const HybridConfig c = tiny_hybrid(DType::f64);
  HybridModel first(c, 3, true, {}, PipelineStage{0, 2}), second(c, 3, true, {}, PipelineStage{1, 2});
  // stage_layers(5, 2, .): [0, 3) and [3, 5): MLA at 1 in the first, attention at 3 in the second.
  REQUIRE(first.qk_clip_sites().size() == 1);
  REQUIRE(second.qk_clip_sites().size() == 1);
  CHECK(first.qk_clip_sites()[0]->layer == "layers.1");
  CHECK(second.qk_clip_sites()[0]->layer == "layers.3");
  check_site_names(first.qk_clip_sites(), shapes_of(first.parameters()));
  check_site_names(second.qk_clip_sites(), shapes_of(second.parameters()));
}
