// Export for users (docs/export.md): one unsharded model directory with Hugging
// Face names and a config.json, and the reader that loads such a directory back.
//
//   GPT-2   GPT2LMHeadModel names and config.json (nn/gpt2_hf.h), Conv1D weights [in, out]
//   hybrid  Kimi-Linear / Kimi-K3 names (model.layers.{i}.self_attn.*, block_sparse_moe.*,
//           experts split per expert: experts.{j}.w1.weight) and a kimi_linear config.json;
//           the full name table is in docs/export.md, the mapping in hybrid_hf_pieces().
//
// Formats: safetensors (model.safetensors; above max_shard_bytes, shards
// model-00001-of-0000N.safetensors plus model.safetensors.index.json), or HDF5 (model.h5,
// one file, one root dataset per tensor; bf16 is stored as uint16 bit patterns).
// Dtypes: f32 or bf16 (round to nearest even of the f32 value; f64 models go through f32).
// In bf16 the tensors Kimi keeps in f32 stay f32: A_log, dt_bias, e_score_correction_bias.
// A directory is built as DIR.tmp.<pid>/ and renamed to DIR once complete, so a failed
// export never leaves a directory that looks complete.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"
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
};

// One tensor of the export as it relates to a model tensor: HF name and shape; row >= 0
// takes row `row` of the model tensor's first dimension (a stacked expert), -1 the whole.
struct HfPiece {
  std::string name;
  Shape shape;
  int64_t row = -1;
};

// The HF pieces of one hybrid-model tensor. `moe_layers` tells whether layer l is an MoE
// layer (its mlp.* tensors go under block_sparse_moe.*). Every model tensor maps to at
// least one piece; the pieces of a whole model have distinct names.
std::vector<HfPiece> hybrid_hf_pieces(const std::string& name, const Shape& shape,
                                      const std::vector<bool>& moe_layers);
// moe_layers for hybrid_hf_pieces from the names of a hybrid state (a layer with
// model.layers.{l}.mlp.gate.weight is an MoE layer).
std::vector<bool> hybrid_moe_layers(const ParameterList& state);

// The tensors of an export, HF names and layouts, in model order, converted to `dtype`
// (f32 or bf16, see above). state: the model's parameters and buffers at full size.
std::vector<std::pair<std::string, Tensor>> hf_export_tensors(const LanguageModel& model, const ParameterList& state,
                                                              DType dtype);
// The config.json text of a model (GPT2LMHeadModel or KimiLinearForCausalLM).
std::string hf_config_json(const LanguageModel& model, DType dtype);

// Writes the directory `dir` (see above): weights, config.json, and config.resolved.yaml
// when `config` is given (so `--checkpoint DIR` works). state: parameters and buffers at
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
class HfWeights {
 public:
  static HfWeights open(const std::string& path);
  struct Entry {
    std::string name;
    Shape shape;
    DType dtype;
    std::string file;  // for messages
  };
  const std::vector<Entry>& entries() const { return entries_; }
  const Entry* find(const std::string& name) const;
  Tensor read(const std::string& name) const;
  const std::string& path() const { return path_; }
  ~HfWeights();
  HfWeights(HfWeights&&) noexcept;
  HfWeights& operator=(HfWeights&&) noexcept;

 private:
  struct Impl;
  HfWeights();
  std::string path_;
  std::vector<Entry> entries_;
  std::unique_ptr<Impl> impl_;
};

// Copies HF-named hybrid weights into `state` (parameters and buffers, converted to their
// dtypes; experts assembled from experts.{j}.*). Strict: every tensor of `state` must be
// present with its shape, and nothing else (errors name the file and the tensor). Files
// written before the export existed (moetrain's internal names: stacked experts
// mlp.experts.w1.weight [E, F, L]) are accepted too when they hold exactly `state`'s names.
// shard: the routed-expert tensors of `state` (group "experts", [E / size, ...]) hold
// global experts [index * E / size, (index + 1) * E / size) (expert parallelism); the
// file's other experts are checked for shape and skipped.
void load_hybrid_hf_weights(ParameterList& state, const HfWeights& weights, ExpertShard shard = {});

}  // namespace moetrain
