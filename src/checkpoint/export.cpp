// Export of a model directory with Hugging Face names, and its reader (export.h,
// docs/export.md).
#include "checkpoint/export.h"
#include "checkpoint/hf_remote_code.h"

#include <signal.h>
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
#include <spdlog/spdlog.h>

#include "checkpoint/safetensors.h"
#include "config/config.h"
#include "core/grad_mode.h"
#include "data/progress.h"
#include "data/hf_tokenizer_files.h"
#include "io/durable.h"
#include "io/hdf5.h"
#include "io/paths.h"
#include "nn/language_model.h"
#include "ops/reduce/reduce.h"
#include "ops/view/view.h"

namespace moetrain {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

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

// ---------------------------------------------------------------- export

namespace {

ParameterList own_state(const LanguageModel& model) {
  ParameterList state = model.parameters();
  const ParameterList buffers = model.buffers();
  state.insert(state.end(), buffers.begin(), buffers.end());
  return state;
}

Tensor to_export_dtype(const Tensor& t, bool keep_f32, DType dtype) {
  Tensor f32 = t.dtype() == DType::f32 ? t : t.to(DType::f32);
  if (dtype == DType::bf16 && !keep_f32) return f32.to(DType::bf16);  // round to nearest even
  return f32;
}

std::unique_ptr<HfAdapter> adapter_of(const LanguageModel& model) {
  std::unique_ptr<HfAdapter> adapter = model.hf_adapter();
  MT_CHECK(adapter, "export: model.arch {} has no Hugging Face layout", model.arch());
  return adapter;
}

}  // namespace

std::vector<std::pair<std::string, Tensor>> hf_export_tensors(const LanguageModel& model, const ParameterList& given,
                                                              DType dtype) {
  MT_CHECK(dtype == DType::f32 || dtype == DType::bf16, "export: dtype {} is not supported (f32 or bf16)", dtype);
  const std::unique_ptr<HfAdapter> adapter = adapter_of(model);
  const ParameterList state = given.empty() ? own_state(model) : given;
  NoGradGuard no_grad;
  std::vector<std::pair<std::string, Tensor>> out;
  for (auto& [name, t] : adapter->export_tensors(state))
    out.emplace_back(name, to_export_dtype(t.detach().to(kCpu).contiguous(), adapter->keeps_f32(name), dtype));
  return out;
}

namespace {

// DIR.tmp.<host>.<pid>, removed on every early exit.
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

// tokenizer.json and tokenizer_config.json of the run's data.tokenizer
// (data/hf_tokenizer_files.h), or one warning saying why the export has none: the
// weights are worth writing without them.
void write_export_tokenizer_files(const fs::path& tmp, const Config& config, const fs::path& out) {
  const std::string name = config.get_string("data.tokenizer"), dir = config.get_string("data.tokenizer_dir");
  std::vector<data::HfTokenizerFile> files;
  try {
    files = data::hf_tokenizer_files(name, dir);
  } catch (const Error& e) {
    spdlog::warn("export {}: no tokenizer files: data.tokenizer {}{} cannot be read here ({}); the model is written "
                 "without tokenizer.json (run export where the tokenizer's files are, paths relative to the current "
                 "directory)", out.string(), name, name == "gpt2" ? " (data.tokenizer_dir " + dir + ")" : "", e.what());
    return;
  }
  for (const data::HfTokenizerFile& f : files) write_file_atomically(tmp / f.name, f.text, false);
}

void export_model_dir_unchecked(const LanguageModel& model, const ParameterList& state, const std::string& dir,
                                const ExportOptions& o, const Config* config) {
  MT_CHECK(o.max_shard_bytes > 0, "export: max shard size must be > 0 bytes, got {}", o.max_shard_bytes);
  fs::path out = fs::path(dir).lexically_normal();
  if (out.filename().empty()) out = out.parent_path();  // "DIR/"
  if (fs::exists(out)) {
    MT_CHECK(fs::is_directory(out), "export: {} is a file, not a directory: an export is a directory; remove it or "
             "choose another path", dir);
    MT_CHECK(o.replace || fs::is_empty(out),
             "export: {} exists and is not empty; choose another --out or pass --force to replace it", dir);
  }
  const std::unique_ptr<HfAdapter> adapter = adapter_of(model);
  const std::vector<std::pair<std::string, Tensor>> tensors = hf_export_tensors(model, state, o.dtype);
  check_finite(state.empty() ? own_state(model) : state, tensors, dir, o.dtype);
  int64_t total = 0;
  for (const auto& kv : tensors) total += kv.second.nbytes();

  fs::path parent = out.parent_path();
  if (!parent.empty()) moetrain::create_directories(parent);
  // What exports into the same --out that were killed before their rename left
  // (`<out>.tmp.<host>.<pid>` of a pid gone from this host): only space, but never
  // swept otherwise.
  for (const fs::path& gone : remove_stale_temp_directories(out))
    spdlog::info("export: removed {}, left by an export that did not finish", gone.string());
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
  write_file_atomically(tmp.path / "config.json", adapter->config_json(o.dtype), false);
  // moetrain_hybrid: transformers has no class of its own, so the export carries ours
  // (python/moetrain_hf/), which config.json's auto_map names (trust_remote_code=True).
  if (adapter->model_type() == kMoetrainHybridModelType)
    for (const HfRemoteCodeFile& f : hf_remote_code_files()) write_file_atomically(tmp.path / f.name, f.text, false);
  if (config && o.tokenizer_files) write_export_tokenizer_files(tmp.path, *config, out);
  if (config) config->save((tmp.path / "config.resolved.yaml").string());
  fsync_path(tmp.path, true);
  progress.finish();

  // Commit: DIR appears complete or not at all.
  replace_directory(tmp.path, out);
  tmp.keep = true;
  const std::vector<std::string> outside = adapter->features_outside_hf();
  if (!outside.empty())
    spdlog::info("export {}: model_type {} (for {}, which transformers' own classes lack): load it with "
                 "trust_remote_code=True, which runs the model code written beside the weights (docs/export.md)",
                 out.string(), adapter->model_type(), fmt::join(outside, ", "));
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
      w.entries_.push_back({e.name, e.shape, file});
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
      index = json::parse(read_regular_file(index_path, "a safetensors index", int64_t{256} << 20));
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
      impl.index[name] = w.entries_.size();
      impl.file_of.push_back(0);
      w.entries_.push_back({name, impl.h5->shape("/", name), file});
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

std::vector<std::string> HfWeights::names() const {
  std::vector<std::string> out;
  out.reserve(entries_.size());
  for (const Entry& e : entries_) out.push_back(e.name);
  return out;
}

std::optional<Shape> HfWeights::shape(const std::string& name) const {
  const Entry* e = find(name);
  return e ? std::optional<Shape>(e->shape) : std::nullopt;
}

std::string HfWeights::where(const std::string& name) const {
  const Entry* e = find(name);
  return e ? e->file : path_;
}

void load_hf_weights(LanguageModel& model, const std::string& path, ExpertShard shard) {
  const std::unique_ptr<HfAdapter> adapter = model.hf_adapter();
  MT_CHECK(adapter, "{}: model.arch {} has no Hugging Face layout to load", path, model.arch());
  ParameterList state = own_state(model);  // weights and buffers (MoE router biases)
  adapter->import_weights(state, HfWeights::open(path), shard);
}

}  // namespace moetrain
