// The Hugging Face adapter of GPT-2 (nn/hf_adapter.h): transformers' GPT2LMHeadModel.
// HF names: wte.weight, wpe.weight, h.{i}.ln_1.*, h.{i}.attn.c_attn.*,
// h.{i}.attn.c_proj.*, h.{i}.ln_2.*, h.{i}.mlp.c_fc.*, h.{i}.mlp.c_proj.*, ln_f.*;
// the four Conv1D weights are stored [in, out] (the transpose of our [out, in]).
// On import a "transformer." prefix is accepted, the attention-mask buffers
// (h.{i}.attn.bias / masked_bias) of older files and lm_head.weight (tied to wte)
// are skipped; anything else unknown or missing is an error naming the tensor.
// config.json fields that change the math are honoured (n_inner, layer_norm_epsilon)
// or refused (docs/export.md has the list).
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "nn/gpt2.h"
#include "nn/hf_adapter.h"

namespace moetrain {

// Fills the architecture fields of `base` (n_layer, n_head, d_model, n_ctx,
// vocab_size, d_ff, layer_norm_eps) from the config.json at `path`. Refuses (Error
// naming the file and the field) what moetrain's GPT-2 does not compute: an untied LM
// head, attention scaled otherwise than by 1/sqrt(head_dim), another activation, cross
// attention, another model_type.
Gpt2Config read_gpt2_hf_config(const std::string& path, Gpt2Config base);
// The config keys of a GPT-2 config.json (read_gpt2_hf_config): model.arch gpt2 and the
// model.* architecture keys.
HfArchitecture gpt2_hf_architecture(const std::string& path);

// The safetensors file of a model path: DIR/model.safetensors, or the path itself.
std::string gpt2_hf_weights_path(const std::string& path);

// Copies HF-named GPT-2 weights into `params` (converting dtypes, e.g. bf16 to f32).
// vocab_size >= 0 with a wte of more rows (a padded vocabulary,
// docs/model.md#padded-vocabulary): the file's wte has vocab_size rows, copied into
// the first ones; the padding rows are set to 0.
void load_gpt2_hf_weights(ParameterList& params, const HfTensorSource& source, int64_t vocab_size = -1);

// The parameters in HF layout (the Conv1D weights transposed to [in, out]), HF names;
// vocab_size >= 0: wte cut to its first vocab_size rows (a padded vocabulary's real rows).
std::vector<std::pair<std::string, Tensor>> gpt2_hf_tensors(const ParameterList& params, int64_t vocab_size = -1);

// The config.json text: GPT2LMHeadModel; dtype from `dtype` (f32 or bf16).
std::string gpt2_hf_config_json(const Gpt2Config& c, DType dtype);

class Gpt2HfAdapter : public HfAdapter {
 public:
  explicit Gpt2HfAdapter(Gpt2Config c) : c_(std::move(c)) {}
  std::string model_type() const override { return "gpt2"; }
  std::vector<std::string> features_outside_hf() const override { return {}; }
  std::string config_json(DType dtype) const override { return gpt2_hf_config_json(c_, dtype); }
  std::vector<std::pair<std::string, Tensor>> export_tensors(const ParameterList& state) const override {
    return gpt2_hf_tensors(state, c_.vocab_size);
  }
  void import_weights(ParameterList& state, const HfTensorSource& source, ExpertShard shard) const override;

 private:
  Gpt2Config c_;
};

}  // namespace moetrain
