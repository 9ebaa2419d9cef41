#include "nn/gpt2_hf.h"

#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include <nlohmann/json.hpp>

#include "checkpoint/export.h"
#include "core/grad_mode.h"
#include "ops/view/view.h"

namespace moetrain {

namespace {

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

}  // namespace

Gpt2Config read_gpt2_hf_config(const std::string& path, Gpt2Config base) {
  std::ifstream in(path);
  MT_CHECK(in.good(), "{}: cannot open the Hugging Face config", path);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    MT_THROW("{}: not valid JSON: {}", path, e.what());
  }
  MT_CHECK(j.is_object(), "{}: expected a JSON object", path);
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
  if (j.contains("activation_function"))
    MT_CHECK(j["activation_function"] == "gelu_new" || j["activation_function"] == "gelu_pytorch_tanh",
             "{}: activation_function {} is not supported (GPT-2 uses \"gelu_new\", the tanh GELU)", path,
             j["activation_function"].dump());
  base.n_layer = get_int("n_layer", 0, true);
  base.n_head = get_int("n_head", 0, true);
  base.d_model = get_int("n_embd", 0, true);
  base.n_ctx = get_int("n_positions", 0, true);
  base.vocab_size = get_int("vocab_size", 0, true);
  base.d_ff = get_int("n_inner", 4 * base.d_model, false);
  if (j.contains("layer_norm_epsilon")) base.layer_norm_eps = j["layer_norm_epsilon"].get<double>();
  MT_CHECK(base.d_model % base.n_head == 0, "{}: n_embd = {} is not divisible by n_head = {}", path, base.d_model,
           base.n_head);
  return base;
}

bool is_hf_model_dir(const std::string& path) {
  return std::filesystem::is_directory(path) && std::filesystem::exists(std::filesystem::path(path) / "config.json");
}

std::string gpt2_hf_weights_path(const std::string& path) {
  if (std::filesystem::is_directory(path)) return (std::filesystem::path(path) / "model.safetensors").string();
  return path;
}

void load_gpt2_hf_weights(Gpt2& model, const std::string& path) {
  HfWeights file = HfWeights::open(path);
  std::map<std::string, const HfWeights::Entry*> by_name;
  for (const HfWeights::Entry& e : file.entries()) {
    std::string name = e.name.rfind("transformer.", 0) == 0 ? e.name.substr(12) : e.name;
    if (is_skipped_buffer(name)) continue;
    by_name[name] = &e;
  }
  std::set<std::string> used;
  NoGradGuard no_grad;
  for (NamedParameter& p : model.parameters()) {
    auto it = by_name.find(p.name);
    MT_CHECK(it != by_name.end(), "{}: missing tensor {} (expected a GPT-2 with {} layers)", path, p.name,
             model.config().n_layer);
    const HfWeights::Entry& e = *it->second;
    Shape on_disk = is_conv1d(p.name) ? Shape{p.tensor.size(1), p.tensor.size(0)} : p.tensor.shape();
    MT_CHECK(e.shape == on_disk, "{}: tensor {} is {} but the model expects {}{}", e.file, e.name, e.shape, on_disk,
             is_conv1d(p.name) ? " (Conv1D layout [in, out])" : "");
    Tensor t = file.read(e.name).to(p.tensor.dtype());
    if (is_conv1d(p.name)) t = transpose(t, 0, 1);  // Conv1D [in, out] -> [out, in]
    copy_(p.tensor, t);
    used.insert(p.name);
  }
  for (const auto& [name, e] : by_name)
    MT_CHECK(used.count(name), "{}: unexpected tensor {} {} (not part of GPT-2)", e->file, e->name, e->shape);
}

std::vector<std::pair<std::string, Tensor>> gpt2_hf_tensors(const ParameterList& params) {
  std::vector<std::pair<std::string, Tensor>> tensors;
  NoGradGuard no_grad;
  for (const NamedParameter& p : params) {
    Tensor t = p.tensor.detach();
    tensors.emplace_back(p.name, is_conv1d(p.name) ? transpose(t, 0, 1) : t);
  }
  return tensors;
}

void export_gpt2_hf(const Gpt2& model, const std::string& dir) {
  ExportOptions options;
  options.replace = true;
  export_model_dir(model, {}, dir, options);
}

std::string gpt2_hf_config_json(const Gpt2Config& c, DType dtype) {
  nlohmann::json j = {{"architectures", {"GPT2LMHeadModel"}},
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
                      {"torch_dtype", dtype == DType::bf16 ? "bfloat16" : "float32"}};
  if (c.vocab_size >= 50257) j["bos_token_id"] = j["eos_token_id"] = 50256;  // GPT-2's <|endoftext|>
  return j.dump(2) + "\n";
}

}  // namespace moetrain
