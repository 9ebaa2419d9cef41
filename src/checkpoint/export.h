// Export for users (docs/export.md): one unsharded model directory with Hugging
// Face names and a config.json, and the reader that loads such a directory back.
// What the names, layouts and config.json are is the model family's business (its HF
// adapter, nn/hf_adapter.h: nn/gpt2_hf.h, nn/hybrid_hf.h); this file holds the
// directory: files, shards, dtypes, atomicity, and reading it back.
//
// Formats: safetensors (model.safetensors; above max_shard_bytes, shards
// model-00001-of-0000N.safetensors plus model.safetensors.index.json), or HDF5 (model.h5,
// one file, one root dataset per tensor; bf16 is stored as uint16 bit patterns).
// Dtypes: f32 or bf16 (round to nearest even of the f32 value; f64 models go through f32).
// In bf16 the tensors the adapter keeps in f32 stay f32 (the hybrid: Kimi's A_log,
// dt_bias, e_score_correction_bias).
// A directory is built as DIR.tmp.<host>.<pid>/ (io/durable.h temp_directory_for) and
// renamed to DIR once complete, so a failed export never leaves a directory that
// looks complete.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"
#include "nn/hf_adapter.h"
#include "nn/moe.h"
#include "nn/parameters.h"

namespace moetrain {

class Config;
class LanguageModel;

enum class ExportFormat { safetensors, hdf5 };
// "safetensors" or "hdf5"; throws naming the value otherwise.
ExportFormat parse_export_format(const std::string& name);
// "f32" or "bf16"; throws naming the value otherwise.
DType parse_export_dtype(const std::string& name);
// "5GB", "500MB", "10kB", "123" (bytes; SI: 1 GB = 1e9 B; also GiB/MiB/KiB); > 0.
int64_t parse_byte_size(const std::string& text);

inline constexpr int64_t kDefaultMaxShardBytes = 5'000'000'000;  // HF's max_shard_size "5GB"

struct ExportOptions {
  ExportFormat format = ExportFormat::safetensors;
  DType dtype = DType::f32;  // f32 or bf16
  int64_t max_shard_bytes = kDefaultMaxShardBytes;  // safetensors only
  bool replace = false;      // replace an existing non-empty directory (else an error)
  bool progress = false;     // a progress bar (terminal) or lines (logs) on stderr, with bytes/s
  // tokenizer.json and tokenizer_config.json for the config's data.tokenizer
  // (data/hf_tokenizer_files.h); when it cannot be read, one warning and none.
  bool tokenizer_files = false;
};

// The tensors of an export, HF names and layouts (the model's HF adapter,
// nn/hf_adapter.h), in model order, converted to `dtype` (f32 or bf16, see above).
// state: the model's parameters and buffers at full size (empty: the model's own).
std::vector<std::pair<std::string, Tensor>> hf_export_tensors(const LanguageModel& model, const ParameterList& state,
                                                              DType dtype);

// Writes the directory `dir` (see above): weights, config.json, and config.resolved.yaml
// when `config` is given (so `--checkpoint DIR` works). When transformers has no class
// that computes the model (HfAdapter::features_outside_hf), logs one line naming the
// features and the model_type written instead. state: parameters and buffers at
// full size (empty: the model's own). Throws naming the path when `dir` exists, is not
// empty and options.replace is false; NumericalError naming the tensor, before anything
// is written, when a tensor holds NaN or infinities (in the model, or after rounding to
// options.dtype); IoError naming the file and the system's message when a write fails
// (`dir` is then as it was and no temp directory is left).
void export_model_dir(const LanguageModel& model, const ParameterList& state, const std::string& dir,
                      const ExportOptions& options, const Config* config = nullptr);

// The tensors of an exported model: a directory (model.safetensors, or
// model.safetensors.index.json and its shards, or model.h5) or one .safetensors file.
// Tensors are read on demand; read() returns a CPU tensor in the file's dtype.
class HfWeights : public HfTensorSource {
 public:
  static HfWeights open(const std::string& path);
  struct Entry {
    std::string name;
    Shape shape;
    std::string file;  // for messages
  };
  const std::vector<Entry>& entries() const { return entries_; }
  const Entry* find(const std::string& name) const;
  const std::string& path() const { return path_; }

  std::vector<std::string> names() const override;
  std::optional<Shape> shape(const std::string& name) const override;
  Tensor read(const std::string& name) const override;
  std::string where(const std::string& name) const override;  // the file holding `name`, else path()

  ~HfWeights() override;
  HfWeights(HfWeights&&) noexcept;
  HfWeights& operator=(HfWeights&&) noexcept;

 private:
  struct Impl;
  HfWeights();
  std::string path_;
  std::vector<Entry> entries_;
  std::unique_ptr<Impl> impl_;
};

// Loads the weights at `path` (anything HfWeights::open reads) into `model` through its
// HF adapter (strict; errors name the file and the tensor). shard: this rank's experts.
void load_hf_weights(LanguageModel& model, const std::string& path, ExpertShard shard = {});

}  // namespace moetrain
