// The hybrid's Hugging Face adapter (nn/hybrid_hf.h): which features make an export
// moetrain_hybrid instead of kimi_linear (the list is transformers 5's
// KimiLinearForCausalLM, read from its modeling code, docs/export.md), config.json in
// both directions, the refusals of kimi_linear configs that class would compute
// otherwise, the tied head and top_k = 1 mappings, and transformers' save format.
#include <catch2/catch.hpp>

#include <functional>
#include <nlohmann/json.hpp>

#include "checkpoint/export.h"
#include "checkpoint/safetensors.h"
#include "moetrain.h"
#include "nn/hybrid_hf.h"
#include "testing.h"

using namespace moetrain;
using moetrain::testing::TempDir;
using nlohmann::json;
using std::string;

namespace {

// What transformers' KimiLinearForCausalLM computes: KDA (softplus gate, low-rank
// output gate, HV = H) and MLA (no gate, NoPE, LoRA eps 1e-6), SwiGLU, sigmoid
// router with a shared expert, residual stream, untied head.
HybridConfig kimi_like() {
  HybridConfig c;
  c.vocab_size = 40;
  c.d_model = 16;
  c.n_ctx = 32;
  c.mixers = {MixerKind::kda, MixerKind::kda, MixerKind::mla};
  c.kda.n_head = 2;
  c.kda.head_dim = 4;
  c.kda.gate = KdaGate::softplus;
  c.kda.full_rank_output_gate = false;
  c.kda.chunk_size = 4;
  c.mla.n_head = 2;
  c.mla.q_lora_rank = 6;
  c.mla.kv_lora_rank = 4;
  c.mla.qk_nope_head_dim = 4;
  c.mla.qk_rope_head_dim = 2;
  c.mla.v_head_dim = 4;
  c.mla.output_gate = false;
  c.ffn.kind = FfnKind::swiglu;
  c.ffn.d_ff = 24;
  c.moe.num_experts = 4;
  c.moe.top_k = 2;
  c.moe.num_shared_experts = 1;
  c.moe.expert_d_ff = 8;
  c.moe.first_dense_layers = 1;
  c.moe.routed_scaling_factor = 2.5;
  c.attn_res = false;
  c.tie_embeddings = false;
  c.init_std = 0.3;
  return c;
}

json config_of(const HybridConfig& c) { return json::parse(hybrid_hf_config_json(c, DType::f32)); }

Tensor ids() {
  Generator gen(3);
  return randint({2, 7}, 40, DType::i32, gen);
}

}  // namespace

TEST_CASE("hybrid hf: every feature transformers' KimiLinear lacks makes the export moetrain_hybrid, by name",
          "[nn][hf]") {
  CHECK(hybrid_features_outside_kimi_linear(kimi_like()).empty());
  CHECK(config_of(kimi_like())["model_type"] == "kimi_linear");
  CHECK(config_of(kimi_like())["architectures"][0] == "KimiLinearForCausalLM");
  struct Case {
    const char* feature;
    std::function<void(HybridConfig&)> change;
  };
  const std::vector<Case> cases = {
      {"MLA output gate", [](HybridConfig& c) { c.mla.output_gate = true; }},
      {"MLA RoPE", [](HybridConfig& c) { c.mla.rope = true; }},
      {"MLA LoRA norm eps 1e-05", [](HybridConfig& c) { c.mla.lora_norm_eps = 1e-5; }},
      {"KDA lower-bound gate", [](HybridConfig& c) { c.kda.gate = KdaGate::lower_bound; }},
      {"full-rank KDA output gate", [](HybridConfig& c) { c.kda.full_rank_output_gate = true; }},
      {"KDA grouped value heads (GVA)", [](HybridConfig& c) { c.kda.n_value_head = 4; }},
      {"softmax router", [](HybridConfig& c) { c.moe.score = RouterScore::softmax; }},
      {"latent MoE experts", [](HybridConfig& c) { c.moe.latent_dim = 8; }},
      {"no shared expert", [](HybridConfig& c) { c.moe.num_shared_experts = 0; }},
      {"expert capacity", [](HybridConfig& c) { c.moe.capacity_factor = 1.25; }},
      {"SiTU-GLU", [](HybridConfig& c) { c.ffn.kind = FfnKind::situ_glu; }},
      {"GELU FFN", [](HybridConfig& c) { c.ffn.kind = FfnKind::gelu; c.moe.num_experts = 0; }},
      {"Block AttnRes", [](HybridConfig& c) { c.attn_res = true; }},
      {"attention mixer", [](HybridConfig& c) { c.mixers[1] = MixerKind::attention; }},
      {"gated_deltanet mixer", [](HybridConfig& c) { c.mixers[0] = MixerKind::gated_deltanet; }},
  };
  for (const Case& k : cases) {
    DYNAMIC_SECTION(k.feature) {
      HybridConfig c = kimi_like();
      k.change(c);
      const std::vector<string> outside = hybrid_features_outside_kimi_linear(c);
      REQUIRE(outside.size() == 1);
      CHECK(outside[0].find(k.feature) == 0);
      CHECK(HybridHfAdapter(c).model_type() == "moetrain_hybrid");
      json j = config_of(c);
      CHECK(j["model_type"] == "moetrain_hybrid");
      CHECK(j["architectures"][0] == "MoetrainHybridForCausalLM");
    }
  }
  // Mapped, not refused: a tied head (written as a copy) and top_k = 1 (no renormalisation).
  HybridConfig tied = kimi_like();
  tied.tie_embeddings = true;
  tied.moe.top_k = 1;
  CHECK(hybrid_features_outside_kimi_linear(tied).empty());
  json j = config_of(tied);
  CHECK(j["model_type"] == "kimi_linear");
  CHECK(j["tie_word_embeddings"] == false);  // the file holds lm_head.weight
  CHECK(j["moe_renormalize"] == false);      // what moetrain computes for one expert
  CHECK(j["moetrain"]["moe_renormalize"] == true);
  CHECK(j["pad_token_id"].is_null());  // transformers' Kimi defaults (163839...) would not fit 40 tokens
  CHECK(j["bos_token_id"].is_null());
  CHECK(j["eos_token_id"].is_null());
  CHECK(j["mlp_layer_types"] == json({"dense", "sparse", "sparse"}));
  CHECK(j["layer_types"] == json({"linear_attention", "linear_attention", "full_attention"}));
}

TEST_CASE("hybrid hf: config.json read back gives the architecture it was written from", "[nn][hf]") {
  TempDir tmp;
  HybridConfig k3 = kimi_like();  // and every moetrain feature at once: moetrain_hybrid
  k3.mixers = {MixerKind::kda, MixerKind::attention, MixerKind::mla, MixerKind::gated_deltanet};
  k3.attention_n_head = 4;
  k3.kda.gate = KdaGate::lower_bound;
  k3.kda.lower_bound = -3.5;
  k3.kda.full_rank_output_gate = true;
  k3.kda.n_value_head = 4;
  k3.mla.output_gate = true;
  k3.mla.rope = true;
  k3.mla.rope_theta = 5000;
  k3.mla.lora_norm_eps = 1e-5;
  k3.ffn.kind = FfnKind::situ_glu;
  k3.ffn.situ_beta = 3;
  k3.ffn.situ_linear_beta = 0;
  k3.ffn.situ_learnable_beta = true;
  k3.moe.latent_dim = 8;
  k3.moe.score = RouterScore::softmax;
  k3.moe.renormalize = false;
  k3.moe.n_group = 2;
  k3.moe.capacity_factor = 1.5;
  k3.attn_res = true;
  k3.attn_res_block_size = 2;
  k3.tie_embeddings = true;
  k3.rms_norm_eps = 1e-6;
  for (const HybridConfig& want : {kimi_like(), k3}) {
    const string path = tmp.write("config.json", hybrid_hf_config_json(want, DType::bf16));
    const HybridConfig got = read_hybrid_hf_config(path);
    CHECK(got.vocab_size == want.vocab_size);
    CHECK(got.d_model == want.d_model);
    CHECK(got.n_ctx == want.n_ctx);
    CHECK(got.mixers == want.mixers);
    CHECK(got.kda.n_head == want.kda.n_head);
    CHECK(got.kda.value_heads() == want.kda.value_heads());
    CHECK(got.kda.head_dim == want.kda.head_dim);
    CHECK(got.kda.gate == want.kda.gate);
    if (want.kda.gate == KdaGate::lower_bound) CHECK(got.kda.lower_bound == want.kda.lower_bound);
    CHECK(got.kda.full_rank_output_gate == want.kda.full_rank_output_gate);
    CHECK(got.mla.q_lora_rank == want.mla.q_lora_rank);
    CHECK(got.mla.kv_lora_rank == want.mla.kv_lora_rank);
    CHECK(got.mla.qk_nope_head_dim == want.mla.qk_nope_head_dim);
    CHECK(got.mla.qk_rope_head_dim == want.mla.qk_rope_head_dim);
    CHECK(got.mla.v_head_dim == want.mla.v_head_dim);
    CHECK(got.mla.output_gate == want.mla.output_gate);
    CHECK(got.mla.rope == want.mla.rope);
    CHECK(got.mla.lora_norm_eps == want.mla.lora_norm_eps);
    CHECK(got.ffn.kind == want.ffn.kind);
    CHECK(got.ffn.d_ff == want.ffn.d_ff);
    CHECK(got.ffn.situ_learnable_beta == want.ffn.situ_learnable_beta);
    CHECK(got.moe.num_experts == want.moe.num_experts);
    CHECK(got.moe.top_k == want.moe.top_k);
    CHECK(got.moe.latent_dim == want.moe.latent_dim);
    CHECK(got.moe.score == want.moe.score);
    CHECK(got.moe.renormalize == want.moe.renormalize);
    CHECK(got.moe.routed_scaling_factor == want.moe.routed_scaling_factor);
    CHECK(got.moe.n_group == want.moe.n_group);
    CHECK(got.moe.capacity_factor == want.moe.capacity_factor);
    CHECK(got.moe.first_dense_layers == want.moe.first_dense_layers);
    CHECK(got.attn_res == want.attn_res);
    CHECK(got.tie_embeddings == want.tie_embeddings);
    CHECK(got.rms_norm_eps == want.rms_norm_eps);
    CHECK(got.attention_n_head == want.attention_n_head);
  }
}

TEST_CASE("hybrid hf: kimi_linear configs that transformers' class would compute otherwise are refused by field",
          "[nn][hf][errors]") {
  TempDir tmp;
  const json base = config_of(kimi_like());
  REQUIRE(base["model_type"] == "kimi_linear");
  struct Case {
    const char* field;
    std::function<void(json&)> change;
  };
  const std::vector<Case> cases = {
      {"num_key_value_heads", [](json& j) { j["num_key_value_heads"] = 1; }},
      {"hidden_act", [](json& j) { j["hidden_act"] = "gelu"; }},
      {"attention_bias", [](json& j) { j["attention_bias"] = true; }},
      {"moe_renormalize", [](json& j) { j["num_experts_per_token"] = 1; j["moe_renormalize"] = true; }},
      {"linear_attn_config.gate_lower_bound", [](json& j) { j["linear_attn_config"]["gate_lower_bound"] = -5.0; }},
      {"linear_attn_config.use_full_rank_gate", [](json& j) { j["linear_attn_config"]["use_full_rank_gate"] = true; }},
      {"mla_use_output_gate", [](json& j) { j["mla_use_output_gate"] = true; }},
      {"mla_use_nope", [](json& j) { j["mla_use_nope"] = false; }},
      {"moe_router_activation_func", [](json& j) { j["moe_router_activation_func"] = "softmax"; }},
      {"routed_expert_hidden_size", [](json& j) { j["routed_expert_hidden_size"] = 8; }},
      {"attn_res_block_size", [](json& j) { j["attn_res_block_size"] = 2; }},
      {"mlp_layer_types", [](json& j) { j["mlp_layer_types"] = json({"sparse", "dense", "sparse"}); }},
      {"moetrain.kda_num_value_heads", [](json& j) { j["moetrain"]["kda_num_value_heads"] = 4; }},
      {"moetrain.layer_mixers", [](json& j) { j["moetrain"]["layer_mixers"] = json({"kda", "attention", "mla"}); }},
  };
  for (const Case& k : cases) {
    DYNAMIC_SECTION(k.field) {
      json j = base;
      k.change(j);
      const string path = tmp.write("config.json", j.dump());
      const string err = testing::error_of([&] { read_hybrid_hf_config(path); });
      CHECK(err.find(path) != string::npos);
      CHECK(err.find(k.field) != string::npos);
    }
  }
  // transformers' own spellings (as save_pretrained writes them) read the same.
  json hf = base;
  hf.erase("max_position_embeddings");
  hf["model_max_length"] = 32;
  hf.erase("num_expert_group");
  hf["n_group"] = 1;
  hf.erase("moetrain");
  hf.erase("linear_attn_config");
  hf["linear_num_heads"] = 2;
  hf["linear_head_dim"] = 4;
  const HybridConfig got = read_hybrid_hf_config(tmp.write("config.json", hf.dump()));
  CHECK(got.n_ctx == 32);
  CHECK(got.kda.n_head == 2);
  CHECK(got.mixers == kimi_like().mixers);  // from layer_types
  CHECK(hybrid_features_outside_kimi_linear(got).empty());
}

TEST_CASE("hybrid hf: a tied head is exported as a copy and read back; transformers' layer-0 MLP names load",
          "[nn][hf]") {
  TempDir tmp;
  HybridConfig c = kimi_like();
  c.tie_embeddings = true;
  HybridModel a(c, 1);
  ExportOptions o;
  export_model_dir(a, {}, tmp / "tied", o);
  SafetensorsFile f = SafetensorsFile::open(tmp / "tied/model.safetensors");
  REQUIRE(f.contains("lm_head.weight"));
  CHECK(testing::bitwise_equal(f.read("lm_head.weight"), f.read("model.embed_tokens.weight")));
  // Back into a tied model (--checkpoint of the export) and into an untied one (its config.json).
  HybridModel b(c, 2);
  load_hf_weights(b, tmp / "tied");
  CHECK(testing::bitwise_equal(a.forward(ids(), false), b.forward(ids(), false)));
  const HybridConfig untied = read_hybrid_hf_config(tmp / "tied/config.json");
  CHECK(!untied.tie_embeddings);
  HybridModel u(untied, 3);
  load_hf_weights(u, tmp / "tied");
  CHECK(testing::rel_error(u.forward(ids(), false), a.forward(ids(), false)) < 1e-6);  // KDA chunk 64, not 4

  // A head that is not the embedding's copy cannot go into a tied model.
  std::vector<std::pair<string, Tensor>> all;
  for (const TensorEntry& e : f.entries())
    all.emplace_back(e.name, e.name == "lm_head.weight" ? mul_scalar(f.read(e.name), 2.0) : f.read(e.name));
  write_safetensors(tmp / "other_head.safetensors", all);
  CHECK_THROWS_WITH(load_hf_weights(b, tmp / "other_head.safetensors"),
                    Catch::Contains("lm_head.weight differs from model.embed_tokens.weight"));

  // transformers' save_pretrained writes a dense layer's MLP under block_sparse_moe.
  HybridModel d(kimi_like(), 4);
  export_model_dir(d, {}, tmp / "plain", o);
  SafetensorsFile p = SafetensorsFile::open(tmp / "plain/model.safetensors");
  std::vector<std::pair<string, Tensor>> hf;
  for (const TensorEntry& e : p.entries()) {
    string name = e.name;
    if (name.rfind("model.layers.0.mlp.", 0) == 0) name = "model.layers.0.block_sparse_moe." + name.substr(19);
    hf.emplace_back(name, p.read(e.name));
  }
  write_safetensors(tmp / "hf_saved.safetensors", hf);
  HybridModel e(kimi_like(), 5);
  load_hf_weights(e, tmp / "hf_saved.safetensors");
  CHECK(testing::bitwise_equal(d.forward(ids(), false), e.forward(ids(), false)));
}
