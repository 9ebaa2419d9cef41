// GPT-2's Hugging Face adapter (gpt2_hf.h, docs/export.md#gpt-2).
#include "nn/gpt2_hf.h"

#include <filesystem>
#include <map>
#include <set>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/grad_mode.h"
#include "ops/view/view.h"

namespace moetrain {

namespace {

using nlohmann::json;

bool is_conv1d(const std::string& name) {
  for (const char* suffix : {".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight"}) {
    std::string s(suffix);
    if (name.size() > s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0) return true;
  }
  return false;
}

bool is_skipped_buffer(const std::string& name) {
  auto ends_with = [&](const std::string& s) {
    return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
  };
  return name == "lm_head.weight" || ends_with(".attn.bias") || ends_with(".attn.masked_bias");
}

// A boolean field that moetrain's GPT-2 computes only at `supported` (absent: HF's default).
void require_bool(const json& j, const std::string& path, const char* key, bool hf_default, bool supported,
                  const char* why) {
  if (!j.contains(key) || j[key].is_null()) {
    MT_ASSERT(hf_default == supported, "GPT-2 field {}: HF's default must be what moetrain computes", key);
    return;
  }
  MT_CHECK(j[key].is_boolean(), "{}: \"{}\" must be true or false, got {}", path, key, j[key].dump());
  MT_CHECK(j[key].get<bool>() == supported, "{}: \"{}\" is {}, which moetrain's GPT-2 does not compute ({}); "
           "moetrain imports only GPT-2s with \"{}\": {}", path, key, j[key].dump(), why, key, supported);
}

}  // namespace

Gpt2Config read_gpt2_hf_config(const std::string& path, Gpt2Config base) {
  const json j = read_hf_config(path);
  auto get_int = [&](const char* key, int64_t fallback, bool required) -> int64_t {
    if (!j.contains(key) || j[key].is_null()) {
      MT_CHECK(!required, "{}: missing \"{}\" (a GPT-2 config.json has n_layer, n_head, n_embd, n_positions, "
               "vocab_size)", path, key);
      return fallback;
    }
    MT_CHECK(j[key].is_number_integer() && j[key].get<int64_t>() > 0, "{}: \"{}\" must be a positive integer, got {}",
             path, key, j[key].dump());
    return j[key].get<int64_t>();
  };
  if (j.contains("model_type"))
    MT_CHECK(j["model_type"] == "gpt2", "{}: model_type is {}, expected \"gpt2\"", path, j["model_type"].dump());
  // Every field of transformers' GPT2Config that changes the forward pass: honoured
  // below (n_inner, layer_norm_epsilon) or refused here. reorder_and_upcast_attn only
  // moves the scaling before the product and upcasts to f32, which moetrain's f32
  // attention does anyway; the dropouts act in training only.
  if (j.contains("activation_function"))
    MT_CHECK(j["activation_function"] == "gelu_new" || j["activation_function"] == "gelu_pytorch_tanh",
             "{}: activation_function {} is not supported (GPT-2 uses \"gelu_new\", the tanh GELU)", path,
             j["activation_function"].dump());
  require_bool(j, path, "tie_word_embeddings", true, true,
               "its LM head is wte; an untied lm_head.weight would be dropped");
  require_bool(j, path, "scale_attn_weights", true, true, "it scales attention scores by 1/sqrt(head_dim)");
  require_bool(j, path, "scale_attn_by_inverse_layer_idx", false, false,
               "it does not scale layer l's attention scores by 1/(l+1)");
  require_bool(j, path, "add_cross_attention", false, false, "it has no cross-attention");
  base.n_layer = get_int("n_layer", 0, true);
  base.n_head = get_int("n_head", 0, true);
  base.d_model = get_int("n_embd", 0, true);
  base.n_ctx = get_int("n_positions", 0, true);
  base.vocab_size = get_int("vocab_size", 0, true);
  base.d_ff = get_int("n_inner", 4 * base.d_model, false);
  if (j.contains("layer_norm_epsilon") && !j["layer_norm_epsilon"].is_null()) {
    MT_CHECK(j["layer_norm_epsilon"].is_number() && j["layer_norm_epsilon"].get<double>() > 0,
             "{}: \"layer_norm_epsilon\" must be a positive number, got {}", path, j["layer_norm_epsilon"].dump());
    base.layer_norm_eps = j["layer_norm_epsilon"].get<double>();
  }
  MT_CHECK(base.d_model % base.n_head == 0, "{}: n_embd = {} is not divisible by n_head = {}", path, base.d_model,
           base.n_head);
  return base;
}

HfArchitecture gpt2_hf_architecture(const std::string& path) {
  const Gpt2Config c = read_gpt2_hf_config(path, Gpt2Config{});
  HfArchitecture a;
  a.model_type = "gpt2";
  a.n_ctx = c.n_ctx;
  a.keys = {{"model.arch", "gpt2"},
            {"model.n_layer", std::to_string(c.n_layer)},
            {"model.n_head", std::to_string(c.n_head)},
            {"model.d_model", std::to_string(c.d_model)},
            {"model.n_ctx", std::to_string(c.n_ctx)},
            {"model.vocab_size", std::to_string(c.vocab_size)},
            {"model.d_ff", std::to_string(c.d_ff)},
            {"model.layer_norm_eps", fmt::format("{:.17g}", c.layer_norm_eps)}};
  return a;
}

std::string gpt2_hf_weights_path(const std::string& path) {
  if (std::filesystem::is_directory(path)) return (std::filesystem::path(path) / "model.safetensors").string();
  return path;
}

void load_gpt2_hf_weights(ParameterList& params, const HfTensorSource& file, int64_t vocab_size) {
  std::map<std::string, std::string> by_name;  // our name -> the file's
  for (const std::string& n : file.names()) {
    std::string name = n.rfind("transformer.", 0) == 0 ? n.substr(12) : n;
    if (is_skipped_buffer(name)) continue;
    by_name[name] = n;
  }
  int64_t n_layer = 0;
  for (const NamedParameter& p : params)
    if (p.name.rfind("h.", 0) == 0) n_layer = std::max<int64_t>(n_layer, std::stoll(p.name.substr(2)) + 1);
  std::set<std::string> used;
  NoGradGuard no_grad;
  for (NamedParameter& p : params) {
    auto it = by_name.find(p.name);
    MT_CHECK(it != by_name.end(), "{}: missing tensor {} (expected a GPT-2 with {} layers)", file.where(p.name), p.name,
             n_layer);
    // A padded vocabulary (docs/model.md#padded-vocabulary): the file holds the
    // vocab_size real rows of wte, the model's padding rows are set to 0.
    const bool padded_wte = p.name == "wte.weight" && vocab_size >= 0 && p.tensor.size(0) > vocab_size;
    const Shape on_disk = is_conv1d(p.name) ? Shape{p.tensor.size(1), p.tensor.size(0)}
                          : padded_wte      ? Shape{vocab_size, p.tensor.size(1)}
                                            : p.tensor.shape();
    const Shape shape = *file.shape(it->second);
    MT_CHECK(shape == on_disk, "{}: tensor {} is {} but the model expects {}{}", file.where(it->second), it->second,
             shape, on_disk,
             is_conv1d(p.name) ? " (Conv1D layout [in, out])"
             : padded_wte      ? fmt::format(" (model.vocab_size {}; the model pads wte to {} rows, the file holds the "
                                             "real ones)", vocab_size, p.tensor.size(0))
                               : std::string());
    Tensor t = read_as(file, it->second, p.tensor.dtype());
    if (is_conv1d(p.name)) t = transpose(t, 0, 1);  // Conv1D [in, out] -> [out, in]
    if (padded_wte) t = concat({t, zeros({p.tensor.size(0) - vocab_size, p.tensor.size(1)}, t.dtype())}, 0);
    copy_(p.tensor, t);
    used.insert(p.name);
  }
  for (const auto& [name, n] : by_name)
    MT_CHECK(used.count(name), "{}: unexpected tensor {} {} (not part of GPT-2)", file.where(n), n, *file.shape(n));
}

void Gpt2HfAdapter::import_weights(ParameterList& state, const HfTensorSource& source, ExpertShard shard) const {
  MT_CHECK(shard.size == 1, "GPT-2 has no experts to shard (expert shard {} of {})", shard.index, shard.size);
  load_gpt2_hf_weights(state, source, c_.vocab_size);
}

std::unique_ptr<HfAdapter> Gpt2::hf_adapter() const { return std::make_unique<Gpt2HfAdapter>(config_); }

std::vector<std::pair<std::string, Tensor>> gpt2_hf_tensors(const ParameterList& params, int64_t vocab_size) {
  std::vector<std::pair<std::string, Tensor>> tensors;
  NoGradGuard no_grad;
  for (const NamedParameter& p : params) {
    Tensor t = p.tensor.detach();
    // A padded vocabulary: the real rows only, so transformers loads vocab_size rows.
    if (p.name == "wte.weight" && vocab_size >= 0 && t.size(0) > vocab_size) t = slice(t, 0, 0, vocab_size);
    tensors.emplace_back(p.name, is_conv1d(p.name) ? transpose(t, 0, 1) : t);
  }
  return tensors;
}

std::string gpt2_hf_config_json(const Gpt2Config& c, DType dtype) {
  const char* dtype_text = dtype == DType::bf16 ? "bfloat16" : "float32";
  // Everything GPT2Config has that changes the math is written, so no default of
  // transformers' decides it; dropout as moetrain's (embeddings and residual
  // branches, not attention probabilities).
  json j = {{"architectures", {"GPT2LMHeadModel"}},
            {"model_type", "gpt2"},
            {"vocab_size", c.vocab_size},
            {"n_positions", c.n_ctx},
            {"n_embd", c.d_model},
            {"n_layer", c.n_layer},
            {"n_head", c.n_head},
            {"n_inner", c.d_ff},
            {"layer_norm_epsilon", c.layer_norm_eps},
            {"activation_function", "gelu_new"},
            {"tie_word_embeddings", true},
            {"scale_attn_weights", true},
            {"scale_attn_by_inverse_layer_idx", false},
            {"reorder_and_upcast_attn", false},
            {"add_cross_attention", false},
            {"embd_pdrop", c.dropout},
            {"resid_pdrop", c.dropout},
            {"attn_pdrop", 0.0},
            {"dtype", dtype_text},
            {"torch_dtype", dtype_text}};
  // GPT-2's <|endoftext|> for its vocabulary; other vocabularies (bytes) have none.
  const json eot = c.vocab_size >= 50257 ? json(50256) : json(nullptr);
  j["bos_token_id"] = eot;
  j["eos_token_id"] = eot;
  j["pad_token_id"] = nullptr;
  return j.dump(2) + "\n";
}

}  // namespace moetrain
