// The hybrid's Hugging Face adapter (hybrid_hf.h, docs/export.md#the-hybrid). What
// transformers computes is read from its 5.x KimiLinearForCausalLM
// (models/kimi_linear/modeling_kimi_linear.py) and conversion_mapping.py's kimi_linear
// entry, which loads Moonshot's names (q/k/v_conv1d, f_a_proj, block_sparse_moe.,
// experts.{j}.w1/w2/w3) into its own modules and writes them back on save.
#include "nn/hybrid_hf.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <set>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/grad_mode.h"
#include "ops/view/view.h"

namespace moetrain {

namespace {

using nlohmann::json;

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// The tensors with one row per token id: padded_vocab_size() rows in a padded model.
bool is_vocab_table(const std::string& name) { return name == "model.embed_tokens.weight" || name == "lm_head.weight"; }

// Layer index of "model.layers.{l}.rest", or -1.
int64_t layer_of(const std::string& name, std::string* rest = nullptr) {
  static const std::string kPrefix = "model.layers.";
  if (name.rfind(kPrefix, 0) != 0) return -1;
  size_t dot = name.find('.', kPrefix.size());
  if (dot == std::string::npos) return -1;
  const std::string digits = name.substr(kPrefix.size(), dot - kPrefix.size());
  if (digits.empty() || digits.find_first_not_of("0123456789") != std::string::npos) return -1;
  if (rest) *rest = name.substr(dot + 1);
  return std::stoll(digits);
}

bool is_kda_kernel_mixer(MixerKind k) {  // mixers that read the model.kda.* keys
  return k == MixerKind::kda || k == MixerKind::deltanet || k == MixerKind::gated_deltanet ||
         k == MixerKind::linear_attention;
}

bool has_mixer(const HybridConfig& c, MixerKind kind) {
  return std::find(c.mixers.begin(), c.mixers.end(), kind) != c.mixers.end();
}

bool has_moe_layer(const HybridConfig& c) {
  for (int64_t l = 0; l < c.n_layer(); ++l)
    if (c.is_moe_layer(l)) return true;
  return false;
}

// transformers' KimiLinearRMSNorm for q_a_layernorm and kv_a_layernorm: eps 1e-6, fixed.
constexpr double kHfMlaNormEps = 1e-6;
// MoeConfig's latent norm epsilon (no config key sets it).
constexpr double kLatentNormEps = MoeConfig{}.latent_norm_eps;

}  // namespace

// ---------------------------------------------------------------- features

std::vector<std::string> hybrid_features_outside_kimi_linear(const HybridConfig& c) {
  std::vector<std::string> out;
  std::set<std::string> others;
  for (MixerKind k : c.mixers)
    if (k != MixerKind::kda && k != MixerKind::mla) others.insert(mixer_kind_name(k));
  for (const std::string& m : others) out.push_back(fmt::format("{} mixer", m));
  if (has_mixer(c, MixerKind::kda)) {
    if (c.kda.gate == KdaGate::lower_bound) out.push_back("KDA lower-bound gate");
    if (c.kda.full_rank_output_gate) out.push_back("full-rank KDA output gate");
    if (c.kda.value_heads() != c.kda.n_head) out.push_back("KDA grouped value heads (GVA)");
  }
  if (has_mixer(c, MixerKind::mla)) {
    if (c.mla.output_gate) out.push_back("MLA output gate");
    if (c.mla.rope) out.push_back("MLA RoPE");
    if (c.mla.lora_norm_eps != kHfMlaNormEps)
      out.push_back(fmt::format("MLA LoRA norm eps {} (transformers: 1e-6)", c.mla.lora_norm_eps));
  }
  // transformers' hidden_act drives the dense MLP, the experts and KDA's short convs (silu).
  if (c.ffn.kind == FfnKind::situ_glu) out.push_back(c.ffn.situ_learnable_beta ? "SiTU-GLU (learnable beta)" : "SiTU-GLU");
  if (c.ffn.kind == FfnKind::gelu) out.push_back("GELU FFN");
  if (c.attn_res) out.push_back("Block AttnRes");
  if (has_moe_layer(c)) {
    if (c.moe.latent_dim > 0) out.push_back("latent MoE experts");
    if (c.moe.score == RouterScore::softmax) out.push_back("softmax router");
    if (c.moe.num_experts / c.moe.n_group < 2) out.push_back("expert groups of one expert");
    if (c.moe.num_shared_experts == 0) out.push_back("no shared expert");
    if (c.moe.capacity_factor > 0) out.push_back(fmt::format("expert capacity (capacity_factor {})", c.moe.capacity_factor));
  }
  return out;
}

std::string HybridHfAdapter::model_type() const {
  return hybrid_features_outside_kimi_linear(c_).empty() ? "kimi_linear" : kMoetrainHybridModelType;
}

bool HybridHfAdapter::keeps_f32(const std::string& hf_name) const {
  return ends_with(hf_name, ".A_log") || ends_with(hf_name, ".dt_bias") ||
         ends_with(hf_name, ".e_score_correction_bias");
}

std::unique_ptr<HfAdapter> HybridModel::hf_adapter() const { return std::make_unique<HybridHfAdapter>(c_); }

// ---------------------------------------------------------------- config.json out

std::string hybrid_hf_config_json(const HybridConfig& c, DType dtype) {
  const bool kimi = hybrid_features_outside_kimi_linear(c).empty();
  json kda_layers = json::array(), full_attn_layers = json::array(), mixers = json::array();
  json layer_types = json::array(), mlp_layer_types = json::array();
  for (int64_t l = 0; l < c.n_layer(); ++l) {  // Kimi's lists are 1-based
    MixerKind k = c.mixers[static_cast<size_t>(l)];
    // Kimi knows KDA and full attention; the ladder's other mixers are in moetrain.layer_mixers only.
    if (k == MixerKind::kda) kda_layers.push_back(l + 1);
    if (k == MixerKind::mla || k == MixerKind::attention) full_attn_layers.push_back(l + 1);
    layer_types.push_back(k == MixerKind::kda ? "linear_attention"
                          : k == MixerKind::mla ? "full_attention"
                                                : mixer_kind_name(k));
    mlp_layer_types.push_back(c.is_moe_layer(l) ? "sparse" : "dense");
    mixers.push_back(mixer_kind_name(k));
  }
  auto or_null = [](int64_t v) { return v > 0 ? json(v) : json(nullptr); };
  const char* act = c.ffn.kind == FfnKind::situ_glu ? "situ" : c.ffn.kind == FfnKind::swiglu ? "silu" : "gelu_pytorch_tanh";
  const char* dtype_text = dtype == DType::bf16 ? "bfloat16" : "float32";
  // transformers' class never ties lm_head to the embedding: a tied model is written with
  // lm_head.weight (a copy, hybrid_hf_tensors) under kimi_linear.
  const bool tie_in_file = c.tie_embeddings && !kimi;
  // Token ids: GPT-2's <|endoftext|> for its vocabulary, none otherwise (a byte-level
  // vocabulary has no special tokens). Written, so transformers' Kimi defaults
  // (163584...) never reach a small embedding.
  const json eot = c.vocab_size >= 50257 ? json(50256) : json(nullptr);
  json j = {
      {"architectures", {kimi ? "KimiLinearForCausalLM" : "MoetrainHybridForCausalLM"}},
      {"model_type", kimi ? "kimi_linear" : kMoetrainHybridModelType},
      {"vocab_size", c.vocab_size},
      {"hidden_size", c.d_model},
      {"num_hidden_layers", c.n_layer()},
      {"intermediate_size", c.ffn.d_ff},
      {"hidden_act", act},
      {"rms_norm_eps", c.rms_norm_eps},
      {"tie_word_embeddings", tie_in_file},
      {"max_position_embeddings", c.n_ctx},
      {"dtype", dtype_text},
      {"torch_dtype", dtype_text},
      {"bos_token_id", eot},
      {"eos_token_id", eot},
      {"pad_token_id", nullptr},
      {"layer_types", layer_types},
      {"mlp_layer_types", mlp_layer_types},
      {"num_attention_heads", c.mla.n_head},
      {"num_key_value_heads", c.mla.n_head},
      {"q_lora_rank", or_null(c.mla.q_lora_rank)},
      {"kv_lora_rank", c.mla.kv_lora_rank},
      {"qk_nope_head_dim", c.mla.qk_nope_head_dim},
      {"qk_rope_head_dim", c.mla.qk_rope_head_dim},
      {"v_head_dim", c.mla.v_head_dim},
      {"mla_use_nope", !c.mla.rope},
      {"mla_use_output_gate", c.mla.output_gate},
      {"rope_theta", c.mla.rope_theta},
      {"attention_bias", false},
      {"attention_dropout", 0.0},
      {"linear_attn_config",
       {{"kda_layers", kda_layers},
        {"full_attn_layers", full_attn_layers},
        {"num_heads", c.kda.n_head},
        {"head_dim", c.kda.head_dim},
        {"short_conv_kernel_size", c.kda.conv_size},
        {"gate_lower_bound", c.kda.gate == KdaGate::lower_bound ? json(c.kda.lower_bound) : json(nullptr)},
        {"use_full_rank_gate", c.kda.full_rank_output_gate}}},
      {"attn_res_block_size", c.attn_res ? json(c.attn_res_block_size) : json(nullptr)},
      {"num_experts", or_null(c.moe.num_experts)},
      {"first_k_dense_replace", c.moe.num_experts > 0 ? std::min(c.moe.first_dense_layers, c.n_layer()) : c.n_layer()},
      {"num_nextn_predict_layers", 0},
  };
  if (c.ffn.kind == FfnKind::situ_glu) {
    j["activation_situ_beta"] = c.ffn.situ_beta;
    j["activation_situ_linear_beta"] = c.ffn.situ_linear_beta > 0 ? json(c.ffn.situ_linear_beta) : json(nullptr);
  }
  if (c.moe.num_experts > 0) {
    j["num_experts_per_token"] = c.moe.top_k;
    j["num_shared_experts"] = c.moe.num_shared_experts;
    j["moe_intermediate_size"] = c.moe.expert_d_ff;
    j["routed_expert_hidden_size"] = or_null(c.moe.latent_dim);
    j["latent_moe_use_norm"] = c.moe.latent_dim > 0 && c.moe.latent_norm;
    j["moe_router_activation_func"] = c.moe.score == RouterScore::sigmoid ? "sigmoid" : "softmax";
    // top_k = 1: moetrain (like DeepSeek-V3 and Moonshot's code) does not renormalise a
    // single weight; transformers' class would (weight 1). false says what is computed.
    j["moe_renormalize"] = c.moe.renormalize && c.moe.top_k > 1;
    j["routed_scaling_factor"] = c.moe.routed_scaling_factor;
    j["use_grouped_topk"] = c.moe.n_group > 1;
    j["num_expert_group"] = c.moe.n_group;
    j["topk_group"] = c.moe.topk_group;
    j["topk_method"] = "noaux_tc";
    j["moe_layer_freq"] = 1;
  }
  // transformers runs a moetrain_hybrid export with the remote code the export carries
  // (python/moetrain_hf/, written by checkpoint/export.cpp): AutoConfig and
  // AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True).
  if (!kimi)
    j["auto_map"] = {{"AutoConfig", "configuration_moetrain_hybrid.MoetrainHybridConfig"},
                     {"AutoModel", "modeling_moetrain_hybrid.MoetrainHybridModel"},
                     {"AutoModelForCausalLM", "modeling_moetrain_hybrid.MoetrainHybridForCausalLM"}};
  // What Kimi's config cannot say: read by moetrain, ignored by others.
  j["moetrain"] = {{"layer_mixers", mixers},
                   {"attention_num_heads", c.attention_n_head},
                   {"kda_num_value_heads", c.kda.value_heads()},
                   {"kda_gate", c.kda.gate == KdaGate::lower_bound ? "lower_bound" : "softplus"},
                   {"ffn", ffn_kind_name(c.ffn.kind)},
                   {"situ_learnable_beta", c.ffn.situ_learnable_beta},
                   {"mla_lora_norm_eps", c.mla.lora_norm_eps},
                   {"latent_norm_eps", c.moe.latent_norm_eps},
                   {"tie_embeddings", c.tie_embeddings},
                   {"moe_renormalize", c.moe.renormalize},
                   {"moe_capacity_factor", c.moe.capacity_factor},
                   {"model_dtype", std::string(dtype_name(c.dtype))}};
  return j.dump(2) + "\n";
}

// ---------------------------------------------------------------- config.json in

namespace {

// The fields of one config.json, each under any of its spellings (transformers writes
// model_max_length for max_position_embeddings, num_expert_group for n_group, ...).
class Fields {
 public:
  Fields(const json& j, std::string path) : j_(j), path_(std::move(path)) {}
  const std::string& path() const { return path_; }

  // The first spelling present and not null, or nullptr.
  const json* find(std::initializer_list<const char*> keys, std::string* which = nullptr) const {
    for (const char* k : keys)
      if (j_.contains(k) && !j_[k].is_null()) {
        if (which) *which = k;
        return &j_[k];
      }
    return nullptr;
  }
  int64_t integer(std::initializer_list<const char*> keys, int64_t fallback, int64_t min = 1) const {
    std::string key;
    const json* v = find(keys, &key);
    if (!v) return fallback;
    MT_CHECK(v->is_number_integer() && v->get<int64_t>() >= min, "{}: \"{}\" must be an integer >= {}, got {}", path_,
             key, min, v->dump());
    return v->get<int64_t>();
  }
  // A nullable integer (null or absent: 0).
  int64_t optional_integer(std::initializer_list<const char*> keys, int64_t fallback = 0) const {
    return find(keys) ? integer(keys, fallback) : fallback;
  }
  double number(std::initializer_list<const char*> keys, double fallback) const {
    std::string key;
    const json* v = find(keys, &key);
    if (!v) return fallback;
    MT_CHECK(v->is_number(), "{}: \"{}\" must be a number, got {}", path_, key, v->dump());
    return v->get<double>();
  }
  bool boolean(std::initializer_list<const char*> keys, bool fallback) const {
    std::string key;
    const json* v = find(keys, &key);
    if (!v) return fallback;
    MT_CHECK(v->is_boolean(), "{}: \"{}\" must be true or false, got {}", path_, key, v->dump());
    return v->get<bool>();
  }
  std::string string(std::initializer_list<const char*> keys, const std::string& fallback) const {
    std::string key;
    const json* v = find(keys, &key);
    if (!v) return fallback;
    MT_CHECK(v->is_string(), "{}: \"{}\" must be a string, got {}", path_, key, v->dump());
    return v->get<std::string>();
  }

 private:
  const json& j_;
  std::string path_;
};

// A kimi_linear config.json asking for what transformers' class does not compute.
[[noreturn]] void refuse_kimi(const std::string& path, const std::string& field, const std::string& value,
                              const std::string& why) {
  MT_THROW("{}: \"{}\" is {}: {}; under model_type kimi_linear moetrain reads a config as transformers' "
           "KimiLinearForCausalLM computes it and will not guess (export models with this feature from moetrain: "
           "they get model_type {}, docs/export.md)", path, field, value, why, kMoetrainHybridModelType);
}

}  // namespace

HybridConfig read_hybrid_hf_config(const std::string& path, HybridConfig c) {
  const json j = read_hf_config(path);
  const std::string type = j.value("model_type", std::string());
  MT_CHECK(type == "kimi_linear" || type == kMoetrainHybridModelType,
           "{}: model_type is {}, expected \"kimi_linear\" or \"{}\"", path, j.contains("model_type") ? j["model_type"].dump() : "absent",
           kMoetrainHybridModelType);
  const bool kimi = type == "kimi_linear";
  const json none = json::object();
  const json& m = j.contains("moetrain") && j["moetrain"].is_object() ? j["moetrain"] : none;
  const json& lac = j.contains("linear_attn_config") && j["linear_attn_config"].is_object() ? j["linear_attn_config"] : none;
  const Fields f(j, path), fm(m, path + " (\"moetrain\")"), fl(lac, path + " (\"linear_attn_config\")");

  // Defaults below are KimiLinearConfig's (transformers 5), for configs that omit a field.
  c.vocab_size = f.integer({"vocab_size"}, 163840);
  c.d_model = f.integer({"hidden_size"}, 2304);
  const int64_t L = f.integer({"num_hidden_layers"}, 27);
  c.n_ctx = f.integer({"max_position_embeddings", "model_max_length"}, 1048576);
  c.rms_norm_eps = f.number({"rms_norm_eps"}, 1e-5);

  // Mixers, as transformers decides them: layer_types, else linear_attn_config's 1-based
  // lists, else full attention at l % 4 == 0 (l > 0).
  std::vector<MixerKind> hf_mixers(static_cast<size_t>(L), MixerKind::kda);
  if (const json* lt = f.find({"layer_types"})) {
    MT_CHECK(lt->is_array() && static_cast<int64_t>(lt->size()) == L, "{}: \"layer_types\" must list {} layers, got {}",
             path, L, lt->dump());
    for (int64_t l = 0; l < L; ++l) {
      const json& t = (*lt)[static_cast<size_t>(l)];
      if (t == "linear_attention") hf_mixers[static_cast<size_t>(l)] = MixerKind::kda;
      else if (t == "full_attention") hf_mixers[static_cast<size_t>(l)] = MixerKind::mla;
      else if (!kimi && t.is_string()) hf_mixers[static_cast<size_t>(l)] = parse_mixer_kind(t.get<std::string>());
      else MT_THROW("{}: \"layer_types\"[{}] is {}; expected \"linear_attention\" or \"full_attention\"", path, l, t.dump());
    }
  } else if (lac.contains("kda_layers") && lac.contains("full_attn_layers")) {
    std::vector<bool> seen(static_cast<size_t>(L), false);
    for (const char* key : {"kda_layers", "full_attn_layers"}) {
      MT_CHECK(lac[key].is_array(), "{}: \"linear_attn_config\".\"{}\" must be a list of layers (1-based)", path, key);
      for (const json& v : lac[key]) {
        MT_CHECK(v.is_number_integer() && v.get<int64_t>() >= 1 && v.get<int64_t>() <= L,
                 "{}: \"linear_attn_config\".\"{}\" holds {}; layers are 1..{}", path, key, v.dump(), L);
        const size_t l = static_cast<size_t>(v.get<int64_t>() - 1);
        seen[l] = true;
        hf_mixers[l] = std::string(key) == "kda_layers" ? MixerKind::kda : MixerKind::mla;
      }
    }
    for (int64_t l = 0; l < L; ++l)
      MT_CHECK(seen[static_cast<size_t>(l)], "{}: \"linear_attn_config\" puts layer {} (1-based) in neither kda_layers "
               "nor full_attn_layers", path, l + 1);
  } else {
    for (int64_t l = 1; l < L; ++l)
      if (l % 4 == 0) hf_mixers[static_cast<size_t>(l)] = MixerKind::mla;
  }
  c.mixers = hf_mixers;
  if (const json* lm = fm.find({"layer_mixers"})) {
    MT_CHECK(lm->is_array() && static_cast<int64_t>(lm->size()) == L, "{}: \"moetrain\".\"layer_mixers\" must list {} "
             "mixers, got {}", path, L, lm->dump());
    for (int64_t l = 0; l < L; ++l) {
      const json& t = (*lm)[static_cast<size_t>(l)];
      MT_CHECK(t.is_string(), "{}: \"moetrain\".\"layer_mixers\"[{}] is {}", path, l, t.dump());
      c.mixers[static_cast<size_t>(l)] = parse_mixer_kind(t.get<std::string>());
    }
    if (kimi && c.mixers != hf_mixers)
      refuse_kimi(path, "moetrain.layer_mixers", lm->dump(), "it differs from the layers transformers builds "
                  "(layer_types / linear_attn_config)");
  }

  // KDA: linear_attn_config wins over transformers' linear_* fields.
  c.kda.n_head = fl.integer({"num_heads"}, f.integer({"linear_num_heads"}, 32));
  c.kda.head_dim = fl.integer({"head_dim"}, f.integer({"linear_head_dim"}, 128));
  c.kda.conv_size = fl.integer({"short_conv_kernel_size"}, f.integer({"linear_conv_kernel_dim"}, 4));
  const int64_t hv = fm.integer({"kda_num_value_heads"}, c.kda.n_head);
  c.kda.n_value_head = hv == c.kda.n_head ? 0 : hv;
  if (const json* lb = fl.find({"gate_lower_bound"})) {
    if (kimi) refuse_kimi(path, "linear_attn_config.gate_lower_bound", lb->dump(), "transformers' KDA uses the softplus gate");
    MT_CHECK(lb->is_number() && lb->get<double>() < 0, "{}: \"linear_attn_config\".\"gate_lower_bound\" must be a "
             "negative number, got {}", path, lb->dump());
    c.kda.gate = KdaGate::lower_bound;
    c.kda.lower_bound = lb->get<double>();
  } else {
    c.kda.gate = KdaGate::softplus;
  }
  const std::string kda_gate = fm.string({"kda_gate"}, c.kda.gate == KdaGate::lower_bound ? "lower_bound" : "softplus");
  MT_CHECK(kda_gate == (c.kda.gate == KdaGate::lower_bound ? "lower_bound" : "softplus"),
           "{}: \"moetrain\".\"kda_gate\" is \"{}\" but \"linear_attn_config\".\"gate_lower_bound\" says otherwise", path,
           kda_gate);
  c.kda.full_rank_output_gate = fl.boolean({"use_full_rank_gate"}, false);
  if (kimi && c.kda.full_rank_output_gate)
    refuse_kimi(path, "linear_attn_config.use_full_rank_gate", "true", "transformers' KDA has the low-rank output gate");
  if (kimi && hv != c.kda.n_head)
    refuse_kimi(path, "moetrain.kda_num_value_heads", std::to_string(hv), "transformers' KDA has one value head per head");

  // MLA.
  c.mla.n_head = f.integer({"num_attention_heads"}, 32);
  const int64_t kv_heads = f.integer({"num_key_value_heads"}, c.mla.n_head);
  MT_CHECK(kv_heads == c.mla.n_head, "{}: \"num_key_value_heads\" is {} but \"num_attention_heads\" is {}: MLA has one "
           "latent for all heads (transformers' class breaks otherwise); they must be equal", path, kv_heads, c.mla.n_head);
  c.mla.q_lora_rank = f.optional_integer({"q_lora_rank"});
  c.mla.kv_lora_rank = f.integer({"kv_lora_rank"}, 512);
  c.mla.qk_nope_head_dim = f.integer({"qk_nope_head_dim"}, 128, 0);
  c.mla.qk_rope_head_dim = f.integer({"qk_rope_head_dim"}, 64, 0);
  c.mla.v_head_dim = f.integer({"v_head_dim"}, 128);
  c.mla.output_gate = f.boolean({"mla_use_output_gate"}, false);
  if (kimi && c.mla.output_gate)
    refuse_kimi(path, "mla_use_output_gate", "true", "transformers' MLA has no output gate");
  c.mla.rope = !f.boolean({"mla_use_nope"}, true);
  if (kimi && c.mla.rope) refuse_kimi(path, "mla_use_nope", "false", "transformers' MLA applies no RoPE");
  c.mla.rope_theta = f.number({"rope_theta"}, c.mla.rope_theta);
  c.mla.lora_norm_eps = fm.number({"mla_lora_norm_eps"}, kHfMlaNormEps);
  MT_CHECK(!f.boolean({"attention_bias"}, false), "{}: \"attention_bias\" is true; moetrain's MLA has no biases", path);

  // FFN: transformers' hidden_act is the dense MLP's, the experts' and KDA's conv activation.
  const std::string act = f.string({"hidden_act"}, "silu");
  if (act == "silu") c.ffn.kind = FfnKind::swiglu;
  else if (!kimi && act == "situ") c.ffn.kind = FfnKind::situ_glu;
  else if (!kimi && act == "gelu_pytorch_tanh") c.ffn.kind = FfnKind::gelu;
  else if (kimi) refuse_kimi(path, "hidden_act", json(act).dump(), "moetrain's KDA convolutions and SwiGLU use silu");
  else MT_THROW("{}: \"hidden_act\" is \"{}\"; expected silu, situ or gelu_pytorch_tanh", path, act);
  if (const json* ffn = fm.find({"ffn"}))
    MT_CHECK(*ffn == ffn_kind_name(c.ffn.kind), "{}: \"moetrain\".\"ffn\" is {} but \"hidden_act\" is \"{}\"", path,
             ffn->dump(), act);
  c.ffn.d_ff = f.integer({"intermediate_size"}, 9216);
  c.ffn.situ_beta = f.number({"activation_situ_beta"}, c.ffn.situ_beta);
  c.ffn.situ_linear_beta = f.find({"activation_situ_linear_beta"}) ? f.number({"activation_situ_linear_beta"}, 0) : 0.0;
  c.ffn.situ_learnable_beta = fm.boolean({"situ_learnable_beta"}, false);

  // MoE: sparse layers from mlp_layer_types, else first_k_dense_replace (transformers').
  const int64_t E = f.optional_integer({"num_experts", "num_local_experts"});
  std::vector<bool> sparse(static_cast<size_t>(L), false);
  if (const json* mt = f.find({"mlp_layer_types"})) {
    MT_CHECK(mt->is_array() && static_cast<int64_t>(mt->size()) == L, "{}: \"mlp_layer_types\" must list {} layers, got "
             "{}", path, L, mt->dump());
    for (int64_t l = 0; l < L; ++l) {
      const json& t = (*mt)[static_cast<size_t>(l)];
      MT_CHECK(t == "dense" || t == "sparse", "{}: \"mlp_layer_types\"[{}] is {}; expected \"dense\" or \"sparse\"", path,
               l, t.dump());
      sparse[static_cast<size_t>(l)] = t == "sparse";
    }
  } else {
    const int64_t k = f.integer({"first_k_dense_replace"}, 1, 0);
    for (int64_t l = k; l < L; ++l) sparse[static_cast<size_t>(l)] = E > 0;
  }
  int64_t first_sparse = L;
  for (int64_t l = L - 1; l >= 0; --l)
    if (sparse[static_cast<size_t>(l)]) first_sparse = l;
  for (int64_t l = first_sparse; l < L; ++l)
    MT_CHECK(sparse[static_cast<size_t>(l)], "{}: \"mlp_layer_types\" has a dense layer {} after the sparse layer {}; "
             "moetrain's MoE layers are all layers from the first sparse one on", path, l, first_sparse);
  MT_CHECK(first_sparse == L || E > 0, "{}: sparse (MoE) layers but \"num_experts\" is null", path);
  c.moe.num_experts = first_sparse < L ? E : 0;
  c.moe.first_dense_layers = first_sparse < L ? first_sparse : c.moe.first_dense_layers;
  if (c.moe.num_experts > 0) {
    c.moe.top_k = f.integer({"num_experts_per_token", "num_experts_per_tok"}, 8);
    c.moe.num_shared_experts = f.integer({"num_shared_experts", "n_shared_experts"}, 1, 0);
    c.moe.expert_d_ff = f.integer({"moe_intermediate_size"}, 1024);
    c.moe.latent_dim = f.optional_integer({"routed_expert_hidden_size"});
    if (kimi && c.moe.latent_dim > 0)
      refuse_kimi(path, "routed_expert_hidden_size", std::to_string(c.moe.latent_dim), "transformers' experts have no latent projections");
    c.moe.latent_norm = f.boolean({"latent_moe_use_norm"}, true);
    const std::string score = f.string({"moe_router_activation_func"}, "sigmoid");
    if (kimi && score != "sigmoid")
      refuse_kimi(path, "moe_router_activation_func", json(score).dump(), "transformers' router is sigmoid");
    MT_CHECK(score == "sigmoid" || score == "softmax", "{}: \"moe_router_activation_func\" is \"{}\"; expected sigmoid or "
             "softmax", path, score);
    c.moe.score = parse_router_score(score);
    const bool renorm = f.boolean({"moe_renormalize", "norm_topk_prob"}, true);
    if (kimi && c.moe.top_k == 1 && renorm)
      refuse_kimi(path, "moe_renormalize", "true", "with num_experts_per_token = 1 transformers renormalises the one "
                  "expert's weight to 1 (times routed_scaling_factor), which moetrain does not compute (it follows "
                  "DeepSeek-V3 and Moonshot: rho * sigmoid score); set moe_renormalize to false to import rho * score");
    c.moe.renormalize = fm.boolean({"moe_renormalize"}, renorm);
    c.moe.routed_scaling_factor = f.number({"routed_scaling_factor"}, 2.446);
    c.moe.n_group = f.integer({"num_expert_group", "n_group"}, 1);
    c.moe.topk_group = f.integer({"topk_group"}, 1);
    c.moe.capacity_factor = fm.number({"moe_capacity_factor"}, 0.0);
    const double latent_eps = fm.number({"latent_norm_eps"}, kLatentNormEps);
    MT_CHECK(latent_eps == kLatentNormEps || c.moe.latent_dim == 0, "{}: \"moetrain\".\"latent_norm_eps\" is {}; "
             "moetrain's latent MoE norm uses {}", path, latent_eps, kLatentNormEps);
  }

  // AttnRes and the head.
  c.attn_res = f.find({"attn_res_block_size"}) != nullptr;
  if (c.attn_res) {
    if (kimi) refuse_kimi(path, "attn_res_block_size", f.find({"attn_res_block_size"})->dump(),
                          "transformers' decoder has the plain residual stream");
    c.attn_res_block_size = f.integer({"attn_res_block_size"}, 12);
  }
  // transformers' class never ties (its lm_head.weight is always its own), whatever
  // tie_word_embeddings says; moetrain_hybrid ties as moetrain.tie_embeddings says.
  c.tie_embeddings = kimi ? false : fm.boolean({"tie_embeddings"}, f.boolean({"tie_word_embeddings"}, false));
  c.attention_n_head = fm.integer({"attention_num_heads"}, c.attention_n_head);

  if (kimi) {
    // Anything the checks above let through that transformers' class still does not compute.
    const std::vector<std::string> outside = hybrid_features_outside_kimi_linear(c);
    MT_CHECK(outside.empty(), "{}: model_type kimi_linear, but the config asks for {}, which transformers' "
             "KimiLinearForCausalLM does not compute", path, fmt::join(outside, ", "));
  }
  return c;
}

HfArchitecture hybrid_hf_architecture(const HybridConfig& c) {
  HfArchitecture a;
  a.n_ctx = c.n_ctx;
  auto add = [&](const std::string& key, const std::string& value) { a.keys.emplace_back(key, value); };
  auto num = [](double v) { return fmt::format("{:.17g}", v); };
  auto flag = [](bool b) { return std::string(b ? "true" : "false"); };
  auto i = [](int64_t v) { return std::to_string(v); };
  std::string mixers;
  for (MixerKind k : c.mixers) {
    if (!mixers.empty()) mixers += ',';
    mixers += mixer_kind_name(k);
  }
  add("model.arch", "hybrid");
  add("model.vocab_size", i(c.vocab_size));
  add("model.d_model", i(c.d_model));
  add("model.n_ctx", i(c.n_ctx));
  add("model.n_layer", i(c.n_layer()));
  add("model.layer_mixers", mixers);
  if (has_mixer(c, MixerKind::attention) || has_mixer(c, MixerKind::linear_attention)) add("model.n_head", i(c.attention_n_head));
  if (std::any_of(c.mixers.begin(), c.mixers.end(), is_kda_kernel_mixer)) {
    add("model.kda.n_head", i(c.kda.n_head));
    add("model.kda.n_value_head", i(c.kda.n_value_head));
    add("model.kda.head_dim", i(c.kda.head_dim));
    add("model.kda.conv_size", i(c.kda.conv_size));
    add("model.kda.gate", c.kda.gate == KdaGate::lower_bound ? "lower_bound" : "softplus");
    if (c.kda.gate == KdaGate::lower_bound) add("model.kda.lower_bound", num(c.kda.lower_bound));
    add("model.kda.full_rank_output_gate", flag(c.kda.full_rank_output_gate));
  }
  if (has_mixer(c, MixerKind::mla)) {
    add("model.mla.n_head", i(c.mla.n_head));
    add("model.mla.q_lora_rank", i(c.mla.q_lora_rank));
    add("model.mla.kv_lora_rank", i(c.mla.kv_lora_rank));
    add("model.mla.qk_nope_head_dim", i(c.mla.qk_nope_head_dim));
    add("model.mla.qk_rope_head_dim", i(c.mla.qk_rope_head_dim));
    add("model.mla.v_head_dim", i(c.mla.v_head_dim));
    add("model.mla.output_gate", flag(c.mla.output_gate));
    add("model.mla.rope", flag(c.mla.rope));
    if (c.mla.rope) add("model.mla.rope_theta", num(c.mla.rope_theta));
    add("model.mla.lora_norm_eps", num(c.mla.lora_norm_eps));
  }
  add("model.ffn", ffn_kind_name(c.ffn.kind));
  add("model.d_ff", i(c.ffn.d_ff));
  if (c.ffn.kind == FfnKind::situ_glu) {
    add("model.situ_beta", num(c.ffn.situ_beta));
    add("model.situ_linear_beta", num(c.ffn.situ_linear_beta));
    add("model.situ_learnable_beta", flag(c.ffn.situ_learnable_beta));
  }
  add("model.moe.num_experts", i(c.moe.num_experts));
  if (c.moe.num_experts > 0) {
    add("model.moe.top_k", i(c.moe.top_k));
    add("model.moe.num_shared_experts", i(c.moe.num_shared_experts));
    add("model.moe.expert_d_ff", i(c.moe.expert_d_ff));
    add("model.moe.latent_dim", i(c.moe.latent_dim));
    if (c.moe.latent_dim > 0) add("model.moe.latent_norm", flag(c.moe.latent_norm));
    add("model.moe.first_dense_layers", i(c.moe.first_dense_layers));
    add("model.moe.router_score", c.moe.score == RouterScore::sigmoid ? "sigmoid" : "softmax");
    add("model.moe.renormalize", flag(c.moe.renormalize));
    add("model.moe.routed_scaling_factor", num(c.moe.routed_scaling_factor));
    add("model.moe.n_group", i(c.moe.n_group));
    add("model.moe.topk_group", i(c.moe.topk_group));
    add("model.moe.capacity_factor", num(c.moe.capacity_factor));
  }
  add("model.attn_res", flag(c.attn_res));
  if (c.attn_res) add("model.attn_res_block_size", i(c.attn_res_block_size));
  add("model.tie_embeddings", flag(c.tie_embeddings));
  add("model.rms_norm_eps", num(c.rms_norm_eps));
  return a;
}

// ---------------------------------------------------------------- name table

std::vector<bool> hybrid_moe_layers(const ParameterList& state) {
  std::vector<bool> moe;
  for (const NamedParameter& p : state) {
    std::string rest;
    int64_t l = layer_of(p.name, &rest);
    if (l < 0 || rest != "mlp.gate.weight") continue;
    if (static_cast<int64_t>(moe.size()) <= l) moe.resize(static_cast<size_t>(l + 1), false);
    moe[static_cast<size_t>(l)] = true;
  }
  return moe;
}

std::vector<HfPiece> hybrid_hf_pieces(const std::string& name, const Shape& shape, const std::vector<bool>& moe_layers) {
  std::string rest;
  const int64_t l = layer_of(name, &rest);
  std::string hf = name;
  Shape hf_shape = shape;
  if (l >= 0) {
    const std::string prefix = fmt::format("model.layers.{}.", l);
    const bool moe = l < static_cast<int64_t>(moe_layers.size()) && moe_layers[static_cast<size_t>(l)];
    if (moe && rest.rfind("mlp.", 0) == 0) {
      std::string sub = rest.substr(4);
      hf = prefix + "block_sparse_moe." + sub;
      // Stacked experts [E, ...] -> experts.{j}.w1.weight [...] (HF: one module per expert).
      for (const char* w : {"w1", "w2", "w3"}) {
        if (sub == fmt::format("experts.{}.weight", w)) {
          MT_CHECK(shape.ndim() == 3, "export: {} is {}, expected stacked experts [E, out, in]", name, shape);
          std::vector<HfPiece> pieces;
          Shape one{shape.size(1), shape.size(2)};
          for (int64_t j = 0; j < shape.size(0); ++j)
            pieces.push_back({fmt::format("{}block_sparse_moe.experts.{}.{}.weight", prefix, j, w), one, j});
          return pieces;
        }
      }
    } else if (rest == "attn_res_proj.weight") {
      hf = prefix + "self_attention_res_proj.weight";
      hf_shape = Shape{1, shape.numel()};  // nn.Linear(D, 1)
    } else if (rest == "attn_res_norm.weight") {
      hf = prefix + "self_attention_res_norm.weight";
    } else if (rest == "mlp_res_proj.weight") {
      hf_shape = Shape{1, shape.numel()};
    } else if (ends_with(rest, "_conv1d.weight") && shape.ndim() == 2) {
      hf_shape = Shape{shape.size(0), 1, shape.size(1)};  // nn.Conv1d(P, P, W, groups=P): [P, 1, W]
    } else if (rest == "self_attn.A_log") {
      hf_shape = Shape{1, 1, shape.numel(), 1};  // Kimi-Linear: A_log.view(1, 1, -1, 1)
    }
  } else if (name == "model.output_attn_res_proj.weight") {
    hf_shape = Shape{1, shape.numel()};
  }
  return {{hf, hf_shape, -1}};
}

std::vector<std::pair<std::string, Tensor>> hybrid_hf_tensors(const ParameterList& state, int64_t vocab_size) {
  std::vector<std::pair<std::string, Tensor>> out;
  NoGradGuard no_grad;
  const std::vector<bool> moe = hybrid_moe_layers(state);
  bool has_head = false;
  Tensor embed;
  for (const NamedParameter& p : state) {
    Tensor t = p.tensor.detach().to(kCpu);
    has_head = has_head || p.name == "lm_head.weight";
    // A padded vocabulary (docs/model.md#padded-vocabulary): the real rows only, so
    // transformers loads vocab_size rows.
    if (is_vocab_table(p.name) && vocab_size >= 0 && t.size(0) > vocab_size) t = slice(t, 0, 0, vocab_size);
    if (p.name == "model.embed_tokens.weight") embed = t;
    for (const HfPiece& piece : hybrid_hf_pieces(p.name, t.shape(), moe)) {
      Tensor part = piece.row >= 0 ? slice(t, 0, piece.row, piece.row + 1) : t;
      out.emplace_back(piece.name, reshape(part, piece.shape).contiguous());
    }
  }
  // Tied: transformers' class has its own lm_head.weight, so the file carries a copy.
  if (!has_head && embed.defined()) out.emplace_back("lm_head.weight", embed.contiguous());
  return out;
}

namespace {

// The HF name under which `source` holds `hf`: itself, or transformers' save-format
// spelling of a dense layer's MLP (model.layers.{l}.block_sparse_moe.{gate,up,down}_proj.*,
// its rename of mlp. on save); empty when neither is there.
std::string find_in_source(const HfTensorSource& source, const std::string& hf) {
  if (source.shape(hf)) return hf;
  std::string rest;
  const int64_t l = layer_of(hf, &rest);
  if (l >= 0 && rest.rfind("mlp.", 0) == 0) {
    const std::string alias = fmt::format("model.layers.{}.block_sparse_moe.{}", l, rest.substr(4));
    if (source.shape(alias)) return alias;
  }
  return {};
}

bool same_values(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape() || a.dtype() != b.dtype()) return false;
  Tensor ca = a.contiguous(), cb = b.contiguous();
  return std::memcmp(ca.raw_data(), cb.raw_data(), static_cast<size_t>(ca.nbytes())) == 0;
}

}  // namespace

void load_hybrid_hf_weights(ParameterList& state, const HfTensorSource& weights, ExpertShard shard,
                            int64_t vocab_size) {
  NoGradGuard no_grad;
  const std::vector<std::string> names = weights.names();
  // Files from before the export (internal names): exactly state's names and shapes.
  bool internal = shard.size == 1 && names.size() == state.size();
  for (const NamedParameter& p : state) {
    const std::optional<Shape> s = weights.shape(p.name);
    internal = internal && s && *s == p.tensor.shape();
  }
  if (internal && !state.empty()) {
    for (NamedParameter& p : state) copy_(p.tensor, read_as(weights, p.name, p.tensor.dtype()));
    return;
  }
  const std::vector<bool> moe = hybrid_moe_layers(state);
  std::set<std::string> used;
  bool has_head = false;
  for (NamedParameter& p : state) {
    has_head = has_head || p.name == "lm_head.weight";
    // An expert shard is matched as the whole [E, ...] tensor; its rows are [lo, lo + rows).
    Shape shape = p.tensor.shape();
    int64_t lo = 0;
    const bool shard_rows = shard.size > 1 && p.group == "experts";
    if (shard_rows) {
      std::vector<int64_t> dims = shape.vec();
      lo = shard.index * dims[0];
      dims[0] *= shard.size;
      shape = Shape(dims);
    }
    // A padded vocabulary (docs/model.md#padded-vocabulary): the file holds the
    // vocab_size real rows (copied into the first ones), the padding rows are set to 0.
    const bool padded = is_vocab_table(p.name) && vocab_size >= 0 && shape[0] > vocab_size;
    const Tensor model_rows = padded ? slice(p.tensor.detach(), 0, 0, vocab_size) : p.tensor.detach();
    if (padded) shape = model_rows.shape();
    for (const HfPiece& piece : hybrid_hf_pieces(p.name, shape, moe)) {
      const std::string name = find_in_source(weights, piece.name);
      MT_CHECK(!name.empty(), "{}: missing tensor {} {} (the weights belong to another architecture or size; see "
               "docs/export.md for the names)", weights.where(piece.name), piece.name, piece.shape);
      const Shape on_disk = *weights.shape(name);
      MT_CHECK(on_disk == piece.shape, "{}: tensor {} is {} but the model expects {}{}", weights.where(name), name,
               on_disk, piece.shape,
               padded ? fmt::format(" (model.vocab_size {}; the model pads it to {} rows, the file holds the real ones)",
                                    vocab_size, p.tensor.size(0))
                      : std::string());
      used.insert(name);
      if (shard_rows && (piece.row < lo || piece.row >= lo + p.tensor.size(0))) continue;  // another rank's expert
      Tensor t = read_as(weights, name, p.tensor.dtype());
      Tensor dst = piece.row >= 0 ? slice(model_rows, 0, piece.row - lo, piece.row - lo + 1) : model_rows;
      copy_(dst, reshape(t, dst.shape()));
    }
    if (padded) {
      const int64_t rows = p.tensor.size(0);
      copy_(slice(p.tensor.detach(), 0, vocab_size, rows), zeros(shape.with(0, rows - vocab_size), p.tensor.dtype()));
    }
  }
  // A tied model reads an export made for transformers (lm_head.weight, a copy of the
  // embedding): accepted when it is that copy.
  if (!has_head && weights.shape("lm_head.weight") && weights.shape("model.embed_tokens.weight")) {
    MT_CHECK(same_values(weights.read("lm_head.weight"), weights.read("model.embed_tokens.weight")),
             "{}: lm_head.weight differs from model.embed_tokens.weight, but the model ties them "
             "(model.tie_embeddings true); build it untied to load this head", weights.where("lm_head.weight"));
    used.insert("lm_head.weight");
  }
  for (const std::string& n : names) {
    std::string rest;
    // K3 allocates layer 0's attention AttnRes pair but never uses it (docs/model.md#layer-0-attention-read-parameters): skipped.
    if (layer_of(n, &rest) == 0 && (rest == "self_attention_res_proj.weight" || rest == "self_attention_res_norm.weight"))
      continue;
    MT_CHECK(used.count(n), "{}: unexpected tensor {} {} (not part of this model)", weights.where(n), n, *weights.shape(n));
  }
}

// ---------------------------------------------------------------- single layers

namespace {

Shape required_shape(const HfTensorSource& w, const std::string& name) {
  if (std::optional<Shape> s = w.shape(name)) return *s;
  (void)w.read(name);  // throws the source's own "missing" message
  MT_THROW("{}: missing tensor {}", w.where(name), name);
}

void expect_shape(const HfTensorSource& w, const std::string& name, const Shape& shape, const Shape& want,
                  const std::string& letters) {
  MT_CHECK(shape == want, "{} is {}; expected {} = {}", w.where(name), shape, letters, want);
}

// [P, 1, W] (transformers' Conv1d) or [P, W]: the width W.
int64_t conv_width(const HfTensorSource& w, const std::string& name, int64_t P) {
  const Shape s = required_shape(w, name);
  const int64_t W = s.ndim() >= 1 ? s[s.ndim() - 1] : 0;
  MT_CHECK(s == (Shape{P, W}) || s == (Shape{P, 1, W}), "{} is {}; expected [P, 1, W] or [P, W] with P = {}",
           w.where(name), s, P);
  return W;
}

}  // namespace

KdaLayerConfig hf_kda_layer_config(const HfTensorSource& w, int64_t D, KdaLayerConfig c) {
  const Shape fa = required_shape(w, "f_a_proj.weight");
  MT_CHECK(fa.ndim() == 2, "{} is {}; expected rank 2 [K, D]", w.where("f_a_proj.weight"), fa);
  const int64_t K = fa[0];
  expect_shape(w, "f_a_proj.weight", fa, Shape{K, D}, "[K, D]");
  const Shape qp = required_shape(w, "q_proj.weight"), vp = required_shape(w, "v_proj.weight");
  MT_CHECK(qp.ndim() == 2 && qp[0] % K == 0, "{} is {}; expected [H*K, D] with K = {} (f_a_proj)",
           w.where("q_proj.weight"), qp, K);
  MT_CHECK(vp.ndim() == 2 && vp[0] % K == 0, "{} is {}; expected [HV*K, D] with K = {} (f_a_proj)",
           w.where("v_proj.weight"), vp, K);
  const int64_t H = qp[0] / K, HV = vp[0] / K;
  expect_shape(w, "q_proj.weight", qp, Shape{H * K, D}, "[H*K, D]");
  expect_shape(w, "k_proj.weight", required_shape(w, "k_proj.weight"), Shape{H * K, D}, "[H*K, D]");
  expect_shape(w, "v_proj.weight", vp, Shape{HV * K, D}, "[HV*K, D]");
  MT_CHECK(HV % H == 0, "{}: HV = {} value heads is not a multiple of H = {}", w.where("v_proj.weight"), HV, H);
  c.d_model = D;
  c.n_head = H;
  c.n_value_head = HV;
  c.head_dim = K;
  c.decay = DeltaDecay::per_channel;
  c.full_rank_output_gate = w.shape("g_proj.weight").has_value();
  c.conv_size = conv_width(w, "q_conv1d.weight", H * K);
  const int64_t wk = conv_width(w, "k_conv1d.weight", H * K), wv = conv_width(w, "v_conv1d.weight", HV * K);
  MT_CHECK(wk == c.conv_size && wv == c.conv_size, "{}: the conv widths differ (q {}, k {}, v {})", w.where(""),
           c.conv_size, wk, wv);
  expect_shape(w, "f_b_proj.weight", required_shape(w, "f_b_proj.weight"), Shape{HV * K, K}, "[HV*K, K]");
  expect_shape(w, "b_proj.weight", required_shape(w, "b_proj.weight"), Shape{HV, D}, "[HV, D]");
  const Shape a_log = required_shape(w, "A_log");
  MT_CHECK(a_log == Shape{HV} || a_log == (Shape{1, 1, HV, 1}), "{} is {}; expected [HV] = [{}] or [1, 1, HV, 1]",
           w.where("A_log"), a_log, HV);
  const Shape dt = required_shape(w, "dt_bias");
  MT_CHECK(dt == Shape{HV * K} || dt == (Shape{HV, K}), "{} is {}; expected [HV*K] = [{}] or [HV, K]", w.where("dt_bias"),
           dt, HV * K);
  if (c.full_rank_output_gate) {
    expect_shape(w, "g_proj.weight", required_shape(w, "g_proj.weight"), Shape{HV * K, D}, "[HV*K, D]");
  } else {
    expect_shape(w, "g_a_proj.weight", required_shape(w, "g_a_proj.weight"), Shape{K, D}, "[K, D]");
    expect_shape(w, "g_b_proj.weight", required_shape(w, "g_b_proj.weight"), Shape{HV * K, K}, "[HV*K, K]");
  }
  expect_shape(w, "o_norm.weight", required_shape(w, "o_norm.weight"), Shape{K}, "[K]");
  expect_shape(w, "o_proj.weight", required_shape(w, "o_proj.weight"), Shape{D, HV * K}, "[D, HV*K]");
  return c;
}

MlaConfig hf_mla_config(const HfTensorSource& w, int64_t D, MlaConfig c) {
  const int64_t H = c.n_head;
  MT_CHECK(H >= 1, "mla: {} heads; expected >= 1", H);
  c.d_model = D;
  int64_t q_rows = 0;
  std::string q_name;
  if (w.shape("q_a_proj.weight")) {
    const Shape qa = required_shape(w, "q_a_proj.weight");
    MT_CHECK(qa.ndim() == 2, "{} is {}; expected [r_q, D]", w.where("q_a_proj.weight"), qa);
    c.q_lora_rank = qa[0];
    expect_shape(w, "q_a_proj.weight", qa, Shape{c.q_lora_rank, D}, "[r_q, D]");
    expect_shape(w, "q_a_layernorm.weight", required_shape(w, "q_a_layernorm.weight"), Shape{c.q_lora_rank}, "[r_q]");
    q_name = "q_b_proj.weight";
    const Shape qb = required_shape(w, q_name);
    MT_CHECK(qb.ndim() == 2, "{} is {}; expected [H*(dn+dr), r_q]", w.where(q_name), qb);
    q_rows = qb[0];
    expect_shape(w, q_name, qb, Shape{q_rows, c.q_lora_rank}, "[H*(dn+dr), r_q]");
  } else {
    c.q_lora_rank = 0;
    q_name = "q_proj.weight";
    const Shape qp = required_shape(w, q_name);
    MT_CHECK(qp.ndim() == 2, "{} is {}; expected [H*(dn+dr), D]", w.where(q_name), qp);
    q_rows = qp[0];
    expect_shape(w, q_name, qp, Shape{q_rows, D}, "[H*(dn+dr), D]");
  }
  const Shape kv_norm = required_shape(w, "kv_a_layernorm.weight");
  MT_CHECK(kv_norm.ndim() == 1, "{} is {}; expected [r_kv]", w.where("kv_a_layernorm.weight"), kv_norm);
  c.kv_lora_rank = kv_norm[0];
  const Shape kv_a = required_shape(w, "kv_a_proj_with_mqa.weight");
  MT_CHECK(kv_a.ndim() == 2 && kv_a[0] >= c.kv_lora_rank && kv_a[1] == D,
           "{} is {}; expected [r_kv + dr, D] with r_kv = {} (kv_a_layernorm)", w.where("kv_a_proj_with_mqa.weight"),
           kv_a, c.kv_lora_rank);
  c.qk_rope_head_dim = kv_a[0] - c.kv_lora_rank;
  const Shape o = required_shape(w, "o_proj.weight");
  MT_CHECK(o.ndim() == 2 && o[0] == D && o[1] % H == 0, "{} is {}; expected [D, H*dv] with D = {}, H = {}",
           w.where("o_proj.weight"), o, D, H);
  c.v_head_dim = o[1] / H;
  MT_CHECK(q_rows % H == 0 && q_rows / H >= c.qk_rope_head_dim, "{} has {} rows; expected H*(dn+dr) with H = {}, dr = {}",
           w.where(q_name), q_rows, H, c.qk_rope_head_dim);
  c.qk_nope_head_dim = q_rows / H - c.qk_rope_head_dim;
  expect_shape(w, "kv_b_proj.weight", required_shape(w, "kv_b_proj.weight"),
               Shape{H * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank}, "[H*(dn+dv), r_kv]");
  c.output_gate = w.shape("g_proj.weight").has_value();
  if (c.output_gate)
    expect_shape(w, "g_proj.weight", required_shape(w, "g_proj.weight"), Shape{H * c.v_head_dim, D}, "[H*dv, D]");
  return c;
}

MoeConfig hf_moe_config(const HfTensorSource& w, int64_t D, MoeConfig c) {
  const Shape gate = required_shape(w, "gate.weight");
  MT_CHECK(gate.ndim() == 2, "{} is {}; expected [E, D]", w.where("gate.weight"), gate);
  const int64_t E = gate[0];
  expect_shape(w, "gate.weight", gate, Shape{E, D}, "[E, D] (D from x)");
  c.num_experts = E;
  MT_CHECK(c.top_k >= 1 && c.top_k <= E, "moe: top_k {}; expected 1..{} (num_experts)", c.top_k, E);
  // Latent projections: all three or none.
  const std::vector<std::string> latent{"routed_expert_down_proj.weight", "routed_expert_up_proj.weight",
                                        "routed_expert_norm.weight"};
  std::vector<std::string> given;
  for (const std::string& n : latent)
    if (w.shape(n)) given.push_back(n);
  MT_CHECK(given.empty() || given.size() == latent.size(),
           "{} holds {} but not all of {}: the latent MoE needs all three (or none for a plain MoE)", w.where(""),
           fmt::join(given, ", "), fmt::join(latent, ", "));
  c.latent_dim = 0;
  if (!given.empty()) {
    const Shape down = required_shape(w, latent[0]);
    MT_CHECK(down.ndim() == 2, "{} is {}; expected [L, D]", w.where(latent[0]), down);
    c.latent_dim = down[0];
    c.latent_norm = true;
    expect_shape(w, latent[0], down, Shape{c.latent_dim, D}, "[L, D]");
    expect_shape(w, latent[1], required_shape(w, latent[1]), Shape{D, c.latent_dim}, "[D, L]");
    expect_shape(w, latent[2], required_shape(w, latent[2]), Shape{c.latent_dim}, "[L]");
  }
  const int64_t W = c.latent_dim > 0 ? c.latent_dim : D;
  const std::string letters = c.latent_dim > 0 ? "L" : "D";
  int64_t F = 0;
  for (int64_t j = 0; j < E; ++j) {
    auto name = [j](const char* m) { return fmt::format("experts.{}.{}.weight", j, m); };
    const Shape w1 = required_shape(w, name("w1"));
    if (j == 0) {
      MT_CHECK(w1.ndim() == 2, "{} is {}; expected [F, {}]", w.where(name("w1")), w1, letters);
      F = w1[0];
    }
    expect_shape(w, name("w1"), w1, Shape{F, W}, fmt::format("[F, {}]", letters));
    expect_shape(w, name("w3"), required_shape(w, name("w3")), Shape{F, W}, fmt::format("[F, {}]", letters));
    expect_shape(w, name("w2"), required_shape(w, name("w2")), Shape{W, F}, fmt::format("[{}, F]", letters));
  }
  c.expert_d_ff = F;
  // Shared experts: one MLP of width F * n_shared (HF fuses them); all three or none.
  const std::vector<std::string> shared{"shared_experts.gate_proj.weight", "shared_experts.up_proj.weight",
                                        "shared_experts.down_proj.weight"};
  given.clear();
  for (const std::string& n : shared)
    if (w.shape(n)) given.push_back(n);
  MT_CHECK(given.empty() || given.size() == shared.size(), "{} holds {} but not all of {}", w.where(""),
           fmt::join(given, ", "), fmt::join(shared, ", "));
  c.num_shared_experts = 0;
  if (!given.empty()) {
    const Shape sg = required_shape(w, shared[0]);
    MT_CHECK(sg.ndim() == 2 && sg[0] % F == 0, "{} is {}; expected [F * n_shared, D] with F = {} (experts.0.w1.weight "
             "rows)", w.where(shared[0]), sg, F);
    const int64_t Fs = sg[0];
    expect_shape(w, shared[0], sg, Shape{Fs, D}, "[F * n_shared, D]");
    expect_shape(w, shared[1], required_shape(w, shared[1]), Shape{Fs, D}, "[F * n_shared, D]");
    expect_shape(w, shared[2], required_shape(w, shared[2]), Shape{D, Fs}, "[D, F * n_shared]");
    c.num_shared_experts = Fs / F;
  }
  if (w.shape("gate.e_score_correction_bias"))
    expect_shape(w, "gate.e_score_correction_bias", *w.shape("gate.e_score_correction_bias"), Shape{E}, "[E]");
  return c;
}

ParamFactory::Supplier hf_layer_supplier(const HfTensorSource& w, bool moe) {
  // The layer is built under a stand-in prefix so that the model's name table applies;
  // the source holds the names below the layer's HF prefix.
  const std::string model_prefix = moe ? "model.layers.0.mlp." : "model.layers.0.self_attn.";
  const std::string hf_prefix = moe ? "model.layers.0.block_sparse_moe." : "model.layers.0.self_attn.";
  const std::vector<bool> moe_layers{moe};
  return [&w, model_prefix, hf_prefix, moe_layers](const std::string& name, const Shape& shape, bool buffer) -> Tensor {
    std::vector<Tensor> parts;
    for (const HfPiece& piece : hybrid_hf_pieces(model_prefix + name, shape, moe_layers)) {
      MT_ASSERT(piece.name.rfind(hf_prefix, 0) == 0, "layer tensor {} maps to {}", name, piece.name);
      const std::string hf = piece.name.substr(hf_prefix.size());
      const std::optional<Shape> s = w.shape(hf);
      if (buffer && !s) return zeros(shape, DType::f32);  // a router bias not given: its init
      if (!s) (void)w.read(hf);                           // the source's own "missing" error
      // The layer configs above checked the shapes (HF's, or the model's own such as a conv
      // weight [P, W], or dt_bias [HV, K]); here only the count must agree.
      MT_CHECK(s->numel() == piece.shape.numel(), "{} is {}; expected {}", w.where(hf), *s, piece.shape);
      Tensor t = buffer ? w.read_buffer(hf) : w.read(hf);
      MT_CHECK(is_floating(t.dtype()), "{} is {}; a layer's weights are floating-point", w.where(hf), t.dtype());
      std::vector<int64_t> dims = shape.vec();
      if (piece.row >= 0) dims[0] = 1;
      parts.push_back(reshape(t, Shape(dims)));
    }
    return parts.size() == 1 ? parts[0] : concat(parts, 0);
  };
}

}  // namespace moetrain
