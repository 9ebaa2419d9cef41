// Export of a model directory with Hugging Face names, and its reader (export.h,
// docs/export.md).
#include "checkpoint/export.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <unordered_map>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "checkpoint/safetensors.h"
#include "config/config.h"
#include "core/grad_mode.h"
#include "data/progress.h"
#include "io/durable.h"
#include "io/hdf5.h"
#include "nn/gpt2.h"
#include "nn/gpt2_hf.h"
#include "nn/hybrid.h"
#include "ops/reduce/reduce.h"
#include "ops/view/view.h"

namespace moetrain {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Tensors Kimi creates in f32 and keeps in f32 in a bf16 checkpoint.
bool keeps_f32(const std::string& hf_name) {
  return ends_with(hf_name, ".A_log") || ends_with(hf_name, ".dt_bias") ||
         ends_with(hf_name, ".e_score_correction_bias");
}

// bf16 values as uint16 bit patterns (HDF5 has no bf16 type) and back.
Tensor bf16_bits(const Tensor& t) {
  Tensor out = empty(t.shape(), DType::u16);
  std::memcpy(out.raw_data(), t.raw_data(), static_cast<size_t>(t.nbytes()));
  return out;
}
Tensor bits_bf16(const Tensor& t) {
  Tensor out = empty(t.shape(), DType::bf16);
  std::memcpy(out.raw_data(), t.raw_data(), static_cast<size_t>(t.nbytes()));
  return out;
}

// Layer index of "model.layers.{l}.rest", or -1.
int64_t layer_of(const std::string& name, std::string* rest = nullptr) {
  static const std::string kPrefix = "model.layers.";
  if (name.rfind(kPrefix, 0) != 0) return -1;
  size_t dot = name.find('.', kPrefix.size());
  if (dot == std::string::npos) return -1;
  int64_t l = std::stoll(name.substr(kPrefix.size(), dot - kPrefix.size()));
  if (rest) *rest = name.substr(dot + 1);
  return l;
}

}  // namespace

ExportFormat parse_export_format(const std::string& name) {
  if (name == "safetensors") return ExportFormat::safetensors;
  if (name == "hdf5") return ExportFormat::hdf5;
  MT_THROW("unknown export format '{}' (safetensors or hdf5)", name);
}

DType parse_export_dtype(const std::string& name) {
  if (name == "f32") return DType::f32;
  if (name == "bf16") return DType::bf16;
  MT_THROW("unknown export dtype '{}' (f32 or bf16)", name);
}

int64_t parse_byte_size(const std::string& text) {
  size_t i = 0;
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.')) ++i;
  std::string number = text.substr(0, i), unit = text.substr(i);
  unit.erase(0, unit.find_first_not_of(' '));
  static const std::map<std::string, double> kUnits = {
      {"", 1},       {"B", 1},         {"kB", 1e3},      {"KB", 1e3},          {"MB", 1e6},
      {"GB", 1e9},   {"TB", 1e12},     {"KiB", 1024.0},  {"MiB", 1048576.0},   {"GiB", 1073741824.0}};
  auto u = kUnits.find(unit);
  double value = 0;
  bool ok = !number.empty() && u != kUnits.end();
  if (ok) {
    try {
      size_t used = 0;
      value = std::stod(number, &used) * u->second;
      ok = used == number.size();
    } catch (const std::exception&) {
      ok = false;
    }
  }
  MT_CHECK(ok && value >= 1 && value < 9.2e18,
           "'{}' is not a size in bytes (examples: 5GB, 500MB, 10kB, 2GiB, 123456)", text);
  return static_cast<int64_t>(value);
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

// ---------------------------------------------------------------- export

namespace {

ParameterList own_state(const LanguageModel& model) {
  ParameterList state = model.parameters();
  const ParameterList buffers = model.buffers();
  state.insert(state.end(), buffers.begin(), buffers.end());
  return state;
}

Tensor to_export_dtype(const Tensor& t, const std::string& hf_name, DType dtype) {
  Tensor f32 = t.dtype() == DType::f32 ? t : t.to(DType::f32);
  if (dtype == DType::bf16 && !keeps_f32(hf_name)) return f32.to(DType::bf16);  // round to nearest even
  return f32;
}

}  // namespace

std::vector<std::pair<std::string, Tensor>> hf_export_tensors(const LanguageModel& model, const ParameterList& given,
                                                              DType dtype) {
  MT_CHECK(dtype == DType::f32 || dtype == DType::bf16, "export: dtype {} is not supported (f32 or bf16)", dtype);
  const ParameterList state = given.empty() ? own_state(model) : given;
  std::vector<std::pair<std::string, Tensor>> out;
  NoGradGuard no_grad;
  if (dynamic_cast<const Gpt2*>(&model)) {
    for (auto& [name, t] : gpt2_hf_tensors(state)) out.emplace_back(name, to_export_dtype(t.to(kCpu), name, dtype));
    return out;
  }
  MT_CHECK(dynamic_cast<const HybridModel*>(&model), "export: model.arch {} has no export layout", model.arch());
  const std::vector<bool> moe = hybrid_moe_layers(state);
  for (const NamedParameter& p : state) {
    Tensor t = p.tensor.detach().to(kCpu);
    for (const HfPiece& piece : hybrid_hf_pieces(p.name, t.shape(), moe)) {
      Tensor part = piece.row >= 0 ? slice(t, 0, piece.row, piece.row + 1) : t;
      out.emplace_back(piece.name, to_export_dtype(reshape(part, piece.shape).contiguous(), piece.name, dtype));
    }
  }
  return out;
}

std::string hf_config_json(const LanguageModel& model, DType dtype) {
  if (const auto* gpt2 = dynamic_cast<const Gpt2*>(&model)) return gpt2_hf_config_json(gpt2->config(), dtype);
  const auto* hybrid = dynamic_cast<const HybridModel*>(&model);
  MT_CHECK(hybrid, "export: model.arch {} has no config.json layout", model.arch());
  const HybridConfig& c = hybrid->config();
  json kda_layers = json::array(), full_attn_layers = json::array(), mixers = json::array();
  for (int64_t l = 0; l < c.n_layer(); ++l) {  // Kimi's lists are 1-based
    MixerKind k = c.mixers[static_cast<size_t>(l)];
    // Kimi knows KDA and full attention; the ladder's other mixers are in moetrain.layer_mixers only.
    if (k == MixerKind::kda) kda_layers.push_back(l + 1);
    if (k == MixerKind::mla || k == MixerKind::attention) full_attn_layers.push_back(l + 1);
    mixers.push_back(mixer_kind_name(k));
  }
  auto or_null = [](int64_t v) { return v > 0 ? json(v) : json(nullptr); };
  const char* act = c.ffn.kind == FfnKind::situ_glu ? "situ" : c.ffn.kind == FfnKind::swiglu ? "silu" : "gelu_pytorch_tanh";
  json j = {
      {"architectures", {"KimiLinearForCausalLM"}},
      {"model_type", "kimi_linear"},
      {"vocab_size", c.vocab_size},
      {"hidden_size", c.d_model},
      {"num_hidden_layers", c.n_layer()},
      {"intermediate_size", c.ffn.d_ff},
      {"hidden_act", act},
      {"rms_norm_eps", c.rms_norm_eps},
      {"tie_word_embeddings", c.tie_embeddings},
      {"max_position_embeddings", c.n_ctx},
      {"torch_dtype", dtype == DType::bf16 ? "bfloat16" : "float32"},
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
    j["moe_renormalize"] = c.moe.renormalize;
    j["routed_scaling_factor"] = c.moe.routed_scaling_factor;
    j["use_grouped_topk"] = c.moe.n_group > 1;
    j["num_expert_group"] = c.moe.n_group;
    j["topk_group"] = c.moe.topk_group;
    j["topk_method"] = "noaux_tc";
    j["first_k_dense_replace"] = c.moe.first_dense_layers;
    j["moe_layer_freq"] = 1;
  }
  // What Kimi's config cannot say: read by moetrain, ignored by others.
  j["moetrain"] = {{"layer_mixers", mixers},
                   {"attention_num_heads", c.attention_n_head},
                   {"kda_num_value_heads", c.kda.value_heads()},
                   {"kda_gate", c.kda.gate == KdaGate::lower_bound ? "lower_bound" : "softplus"},
                   {"ffn", ffn_kind_name(c.ffn.kind)},
                   {"situ_learnable_beta", c.ffn.situ_learnable_beta},
                   {"mla_lora_norm_eps", c.mla.lora_norm_eps},
                   {"latent_norm_eps", c.moe.latent_norm_eps},
                   {"model_dtype", std::string(dtype_name(c.dtype))}};
  return j.dump(2) + "\n";
}

namespace {

// DIR.tmp.<pid>, removed on every early exit.
struct TempDirGuard {
  fs::path path;
  bool keep = false;
  ~TempDirGuard() {
    if (!keep) {
      std::error_code ec;
      fs::remove_all(path, ec);
    }
  }
};

void write_safetensors_dir(const fs::path& dir, const std::vector<std::pair<std::string, Tensor>>& tensors,
                           int64_t max_shard_bytes, const std::function<void(int64_t)>& on_written) {
  // Greedy in model order, as transformers' max_shard_size: a tensor larger than the
  // limit gets a shard of its own.
  std::vector<std::vector<std::pair<std::string, Tensor>>> shards(1);
  int64_t in_shard = 0, total = 0;
  for (const auto& kv : tensors) {
    int64_t n = kv.second.nbytes();
    if (!shards.back().empty() && in_shard + n > max_shard_bytes) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back(kv);
    in_shard += n;
    total += n;
  }
  if (shards.size() == 1) {
    write_safetensors((dir / "model.safetensors").string(), shards[0], {}, on_written);
    return;
  }
  json weight_map = json::object();
  const size_t n = shards.size();
  for (size_t i = 0; i < n; ++i) {
    std::string file = fmt::format("model-{:05d}-of-{:05d}.safetensors", i + 1, n);
    write_safetensors((dir / file).string(), shards[i], {}, on_written);
    for (const auto& kv : shards[i]) weight_map[kv.first] = file;
  }
  json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  write_file_atomically(dir / "model.safetensors.index.json", index.dump(2) + "\n", false);
}

void write_hdf5(const fs::path& dir, const std::vector<std::pair<std::string, Tensor>>& tensors, DType dtype,
                const std::function<void(int64_t)>& on_written) {
  hdf5::Writer w((dir / "model.h5").string());
  w.set_attribute("/", "format", std::string("moetrain-export"));
  w.set_attribute("/", "dtype", std::string(dtype == DType::bf16 ? "bf16" : "f32"));
  w.set_attribute("/", "bf16_encoding", std::string("uint16 datasets hold bf16 bit patterns (the upper half of f32)"));
  for (const auto& [name, t] : tensors) {
    w.write("/", name, t.dtype() == DType::bf16 ? bf16_bits(t) : t);
    if (on_written) on_written(t.nbytes());
  }
  w.commit();
}

// An export never holds NaN or infinities: neither from the model (a diverged run)
// nor from the conversion (f32 values beyond bf16's largest, 3.39e38, round to inf;
// f64 beyond f32's to inf). Checked before anything is written.
void check_finite(const ParameterList& state, const std::vector<std::pair<std::string, Tensor>>& tensors,
                  const std::string& dir, DType dtype) {
  if (const std::optional<NonFiniteTensor> bad = find_non_finite(state))
    throw NumericalError(fmt::format("export to {}: the model's tensor {}; refusing to write a model with non-finite "
                                     "weights (nothing was written; export an earlier checkpoint)", dir,
                                     describe(*bad)));
  for (const auto& [name, t] : tensors)
    if (const int64_t n = count_non_finite(t); n > 0)
      throw NumericalError(fmt::format(
          "export to {}: rounded to {}, tensor {} (the model's values there are beyond {}'s range); refusing to "
          "write them (nothing was written{})", dir, dtype_name(t.dtype()), describe(NonFiniteTensor{name, t.shape(), n}),
          dtype_name(t.dtype()), dtype == DType::bf16 ? "; export with --dtype f32" : ""));
}

void export_model_dir_unchecked(const LanguageModel& model, const ParameterList& state, const std::string& dir,
                                const ExportOptions& o, const Config* config) {
  MT_CHECK(o.max_shard_bytes > 0, "export: max shard size must be > 0 bytes, got {}", o.max_shard_bytes);
  fs::path out = fs::path(dir).lexically_normal();
  if (out.filename().empty()) out = out.parent_path();  // "DIR/"
  if (fs::exists(out)) {
    MT_CHECK(fs::is_directory(out), "export: {} exists and is not a directory", dir);
    MT_CHECK(o.replace || fs::is_empty(out),
             "export: {} exists and is not empty; choose another --out or pass --force to replace it", dir);
  }
  const std::vector<std::pair<std::string, Tensor>> tensors = hf_export_tensors(model, state, o.dtype);
  check_finite(state.empty() ? own_state(model) : state, tensors, dir, o.dtype);
  int64_t total = 0;
  for (const auto& kv : tensors) total += kv.second.nbytes();

  fs::path parent = out.parent_path();
  if (!parent.empty()) moetrain::create_directories(parent);
  TempDirGuard tmp{temp_directory_for(out)};
  std::error_code ec;
  fs::remove_all(tmp.path, ec);  // a leftover of an earlier process with our pid
  if (::mkdir(tmp.path.c_str(), 0755) != 0)
    throw IoError(fmt::format("cannot create directory {}: {}", tmp.path.string(), std::strerror(errno)));

  data::Progress progress(fmt::format("export {}", out.filename().string()), total,
                          data::ProgressOptions::bytes(o.progress));
  auto on_written = [&](int64_t n) { progress.update(n); };
  if (o.format == ExportFormat::safetensors) write_safetensors_dir(tmp.path, tensors, o.max_shard_bytes, on_written);
  else write_hdf5(tmp.path, tensors, o.dtype, on_written);
  write_file_atomically(tmp.path / "config.json", hf_config_json(model, o.dtype), false);
  if (config) config->save((tmp.path / "config.resolved.yaml").string());
  fsync_path(tmp.path, true);
  progress.finish();

  // Commit: DIR appears complete or not at all.
  replace_directory(tmp.path, out);
  tmp.keep = true;
}

}  // namespace

void export_model_dir(const LanguageModel& model, const ParameterList& state, const std::string& dir,
                      const ExportOptions& options, const Config* config) {
  // A failed write names the file and the system's message; the temp directory is
  // gone and DIR is as it was, which the message says.
  try {
    export_model_dir_unchecked(model, state, dir, options, config);
  } catch (const IoError& e) {
    throw IoError(fmt::format("export to {} failed: {}; {} was left as it was", dir, e.what(), dir));
  } catch (const fs::filesystem_error& e) {
    throw IoError(fmt::format("export to {} failed: {}: {}; {} was left as it was", dir, e.path1().string(),
                              e.code().message(), dir));
  }
}

// ---------------------------------------------------------------- reading

struct HfWeights::Impl {
  std::vector<SafetensorsFile> files;
  std::unique_ptr<hdf5::Reader> h5;
  bool h5_bf16 = false;  // the HDF5 file's uint16 datasets hold bf16 bits
  std::unordered_map<std::string, size_t> index;  // name -> entries_ position
  std::vector<size_t> file_of;                     // entries_ position -> files index
};

HfWeights::HfWeights() : impl_(std::make_unique<Impl>()) {}
HfWeights::~HfWeights() = default;
HfWeights::HfWeights(HfWeights&&) noexcept = default;
HfWeights& HfWeights::operator=(HfWeights&&) noexcept = default;

HfWeights HfWeights::open(const std::string& path) {
  HfWeights w;
  w.path_ = path;
  Impl& impl = *w.impl_;
  auto add_file = [&](const std::string& file, const std::set<std::string>* only) {
    impl.files.push_back(SafetensorsFile::open(file));
    for (const TensorEntry& e : impl.files.back().entries()) {
      if (only && !only->count(e.name)) continue;
      MT_CHECK(!impl.index.count(e.name), "{}: tensor {} is also in {}", file, e.name,
               w.entries_[impl.index[e.name]].file);
      impl.index[e.name] = w.entries_.size();
      impl.file_of.push_back(impl.files.size() - 1);
      w.entries_.push_back({e.name, e.shape, e.dtype, file});
    }
  };
  const fs::path p(path);
  MT_CHECK(fs::exists(p), "{}: no such file or directory", path);
  if (!fs::is_directory(p)) {
    add_file(path, nullptr);
    return w;
  }
  if (fs::exists(p / "model.safetensors")) {
    add_file((p / "model.safetensors").string(), nullptr);
  } else if (fs::exists(p / "model.safetensors.index.json")) {
    const std::string index_path = (p / "model.safetensors.index.json").string();
    json index;
    try {
      std::ifstream in(index_path);
      index = json::parse(in);
    } catch (const json::exception& e) {
      MT_THROW("{}: not valid JSON: {}", index_path, e.what());
    }
    MT_CHECK(index.is_object() && index.contains("weight_map") && index["weight_map"].is_object(),
             "{}: expected an object with a \"weight_map\" object", index_path);
    std::map<std::string, std::set<std::string>> by_file;
    for (auto& [name, file] : index["weight_map"].items()) {
      MT_CHECK(file.is_string(), "{}: weight_map[\"{}\"] is not a file name", index_path, name);
      by_file[file.get<std::string>()].insert(name);
    }
    for (const auto& [file, names] : by_file) {
      MT_CHECK(file.find('/') == std::string::npos && fs::exists(p / file), "{}: shard {} (of {} tensors) is missing",
               index_path, file, names.size());
      add_file((p / file).string(), &names);
      for (const std::string& name : names)
        MT_CHECK(impl.index.count(name), "{}: weight_map puts {} in {}, which does not hold it", index_path, name, file);
    }
  } else if (fs::exists(p / "model.h5")) {
    const std::string file = (p / "model.h5").string();
    impl.h5 = std::make_unique<hdf5::Reader>(file);
    const bool bf16 = impl.h5->attr_string("/", "dtype").value_or("f32") == "bf16";
    impl.h5_bf16 = bf16;
    for (const std::string& name : impl.h5->datasets("/")) {
      // The dtype by the writer's rule (read() goes by the dataset's own type).
      DType d = bf16 && !keeps_f32(name) ? DType::bf16 : DType::f32;
      impl.index[name] = w.entries_.size();
      impl.file_of.push_back(0);
      w.entries_.push_back({name, impl.h5->shape("/", name), d, file});
    }
  } else {
    MT_THROW("{}: no weights (expected model.safetensors, model.safetensors.index.json or model.h5)", path);
  }
  return w;
}

const HfWeights::Entry* HfWeights::find(const std::string& name) const {
  auto it = impl_->index.find(name);
  return it == impl_->index.end() ? nullptr : &entries_[it->second];
}

Tensor HfWeights::read(const std::string& name) const {
  const Entry* e = find(name);
  MT_CHECK(e, "{}: no tensor {}", path_, name);
  if (impl_->h5) {
    Tensor t = impl_->h5->read("/", name);
    return t.dtype() == DType::u16 && impl_->h5_bf16 ? bits_bf16(t) : t;
  }
  return impl_->files[impl_->file_of[impl_->index.at(name)]].read(name);
}

void load_hybrid_hf_weights(ParameterList& state, const HfWeights& weights, ExpertShard shard) {
  NoGradGuard no_grad;
  // Files from before the export (internal names): exactly state's names and shapes.
  bool internal = shard.size == 1 && weights.entries().size() == state.size();
  for (const NamedParameter& p : state) {
    const HfWeights::Entry* e = weights.find(p.name);
    internal = internal && e && e->shape == p.tensor.shape();
  }
  if (internal && !state.empty()) {
    for (NamedParameter& p : state) copy_(p.tensor, weights.read(p.name).to(p.tensor.dtype()));
    return;
  }
  const std::vector<bool> moe = hybrid_moe_layers(state);
  std::set<std::string> used;
  for (NamedParameter& p : state) {
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
    for (const HfPiece& piece : hybrid_hf_pieces(p.name, shape, moe)) {
      const HfWeights::Entry* e = weights.find(piece.name);
      MT_CHECK(e, "{}: missing tensor {} {} (the weights belong to another architecture or size; see "
               "docs/export.md for the names)", weights.path(), piece.name, piece.shape);
      MT_CHECK(e->shape == piece.shape, "{}: tensor {} is {} but the model expects {}", e->file, e->name, e->shape,
               piece.shape);
      used.insert(piece.name);
      if (shard_rows && (piece.row < lo || piece.row >= lo + p.tensor.size(0))) continue;  // another rank's expert
      Tensor t = weights.read(piece.name).to(p.tensor.dtype());
      Tensor dst = piece.row >= 0 ? slice(p.tensor.detach(), 0, piece.row - lo, piece.row - lo + 1) : p.tensor.detach();
      copy_(dst, reshape(t, dst.shape()));
    }
  }
  for (const HfWeights::Entry& e : weights.entries()) {
    std::string rest;
    // K3 allocates layer 0's attention AttnRes pair but never uses it (docs/model.md#layer-0-attention-read-parameters): skipped.
    if (layer_of(e.name, &rest) == 0 && (rest == "self_attention_res_proj.weight" || rest == "self_attention_res_norm.weight"))
      continue;
    MT_CHECK(used.count(e.name), "{}: unexpected tensor {} {} (not part of this model)", e.file, e.name, e.shape);
  }
}

}  // namespace moetrain
