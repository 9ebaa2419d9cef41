// Hugging Face interop of a model family (docs/export.md). Each family owns one adapter
// beside its model, holding its name table, config.json in both directions and the
// import and export of its weights: nn/gpt2_hf.h (GPT2LMHeadModel), nn/hybrid_hf.h
// (Kimi-Linear / Kimi-K3 names). A model hands out its adapter
// (LanguageModel::hf_adapter()); `moetrain export`, model.init_from / --init-from and
// `moetrain op`'s layer loaders all go through it. File formats are not the adapters'
// business: they read an HfTensorSource (checkpoint/export.h opens safetensors
// directories and HDF5 exports as one; `moetrain op` wraps its params/ group) and
// return tensors for checkpoint/export.h to write.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "core/tensor.h"
#include "nn/moe.h"
#include "nn/parameters.h"

namespace moetrain {

// Named tensors read on demand: a model directory, one .safetensors file, an HDF5 group.
class HfTensorSource {
 public:
  virtual ~HfTensorSource() = default;
  virtual std::vector<std::string> names() const = 0;
  // The shape of `name`, nullopt when the source has no such tensor.
  virtual std::optional<Shape> shape(const std::string& name) const = 0;
  // The tensor (in the source's dtype); throws naming the source when there is none.
  virtual Tensor read(const std::string& name) const = 0;
  // A buffer: state that is not trained (the router bias), where a source tells them
  // apart (`moetrain op` gives parameters gradients, buffers none).
  virtual Tensor read_buffer(const std::string& name) const { return read(name); }
  // Where `name` is, for messages: "DIR/model-00002-of-00003.safetensors", "in.h5:/g/params/x";
  // where("") is the source as a whole.
  virtual std::string where(const std::string& name) const = 0;
};

// A config.json as a JSON object; errors name the path (missing, not JSON, not an object).
nlohmann::json read_hf_config(const std::string& path);

// source.read(name) converted to `dtype`, the dtype of the tensor it fills; an
// integer tensor for a float one (or the reverse) is an Error naming the source
// file, the tensor and both dtypes, never a silent conversion.
Tensor read_as(const HfTensorSource& source, const std::string& name, DType dtype);

// config.json's model_type for models transformers has no class for: the hybrid
// with features KimiLinearForCausalLM does not compute (docs/export.md).
inline constexpr const char* kMoetrainHybridModelType = "moetrain_hybrid";

class HfAdapter {
 public:
  virtual ~HfAdapter() = default;
  // config.json's model_type: transformers' own ("gpt2", "kimi_linear") when its class
  // for that type computes exactly this model, else moetrain's own (kMoetrainHybridModelType).
  virtual std::string model_type() const = 0;
  // The model's features that transformers' class for the family's type does not
  // compute: why model_type() is moetrain's own (empty when it is transformers').
  virtual std::vector<std::string> features_outside_hf() const = 0;
  // The config.json text; `dtype` (f32 or bf16) is the exported weights' dtype.
  virtual std::string config_json(DType dtype) const = 0;
  // The tensors under HF names and layouts, in model order, in the state's dtype.
  // state: the model's parameters and buffers at full size (every expert).
  virtual std::vector<std::pair<std::string, Tensor>> export_tensors(const ParameterList& state) const = 0;
  // Tensors the family keeps in f32 in a bf16 export (by HF name).
  virtual bool keeps_f32(const std::string& hf_name) const { return false; }
  // Copies HF-named weights into `state` (parameters and buffers, converted to their
  // dtypes). Strict: every tensor of `state` must be present with its shape and
  // nothing else; errors name the file and the tensor. shard: the routed experts of
  // `state` hold this rank's rows only.
  virtual void import_weights(ParameterList& state, const HfTensorSource& source, ExpertShard shard = {}) const = 0;
};

// The architecture a config.json describes, as config keys (YAML scalar text, for
// Config::set): model.arch first, then every model.* key of the architecture.
// Supported model_type: gpt2 (also when absent), kimi_linear, moetrain_hybrid; fields
// that change the math and that moetrain cannot honour are refused (Error naming the
// file and the field, exit 2).
struct HfArchitecture {
  std::string model_type;
  std::vector<std::pair<std::string, std::string>> keys;
  int64_t n_ctx = 0;  // model.n_ctx among keys (train.seq_len is capped by it)
};
HfArchitecture read_hf_architecture(const std::string& config_json_path);

// True when `path` is a directory holding a config.json.
bool is_hf_model_dir(const std::string& path);

}  // namespace moetrain
