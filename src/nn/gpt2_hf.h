// Hugging Face GPT-2 interop: config.json + model.safetensors in, the same out.
// HF names: wte.weight, wpe.weight, h.{i}.ln_1.*, h.{i}.attn.c_attn.*,
// h.{i}.attn.c_proj.*, h.{i}.ln_2.*, h.{i}.mlp.c_fc.*, h.{i}.mlp.c_proj.*, ln_f.*;
// the four Conv1D weights are stored [in, out] (the transpose of our [out, in]).
// On import a "transformer." prefix is accepted, the attention-mask buffers
// (h.{i}.attn.bias / masked_bias) of older files and lm_head.weight (tied to wte)
// are skipped; anything else unknown or missing is an error naming the tensor.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "nn/gpt2.h"

namespace moetrain {

// Fills the architecture fields of `base` (n_layer, n_head, d_model, n_ctx,
// vocab_size, d_ff, layer_norm_eps) from a config.json.
Gpt2Config read_gpt2_hf_config(const std::string& config_json, Gpt2Config base);

// The safetensors file of a model path: DIR/model.safetensors, or the path itself.
std::string gpt2_hf_weights_path(const std::string& path);
// True when `path` is a directory holding a config.json.
bool is_hf_model_dir(const std::string& path);

// Copies the weights of a model directory (model.safetensors, sharded safetensors with
// model.safetensors.index.json, or an HDF5 export: checkpoint/export.h) or of one
// .safetensors file into `model` (converting dtypes, e.g. bf16 to f32).
void load_gpt2_hf_weights(Gpt2& model, const std::string& path);

// The parameters in HF layout (the Conv1D weights transposed to [in, out]), HF names.
std::vector<std::pair<std::string, Tensor>> gpt2_hf_tensors(const ParameterList& params);
// Writes DIR/model.safetensors (f32, HF layout and names) and DIR/config.json, replacing
// DIR (export_model_dir in checkpoint/export.h with its defaults).
void export_gpt2_hf(const Gpt2& model, const std::string& dir);

// The config.json text: GPT2LMHeadModel; torch_dtype from `dtype` (f32 or bf16).
std::string gpt2_hf_config_json(const Gpt2Config& c, DType dtype);

}  // namespace moetrain
