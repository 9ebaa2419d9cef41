// Gpt2Config from the resolved YAML config (keys documented in src/config/schema.cpp).
#include "config/config.h"
#include "nn/gpt2.h"

namespace moetrain {

Gpt2Config Gpt2Config::from(const Config& config) {
  Gpt2Config c;
  c.vocab_size = config.get_int("model.vocab_size");
  c.vocab_pad_multiple = config.get_int("model.vocab_pad_multiple");
  c.n_layer = config.get_int("model.n_layer");
  c.n_head = config.get_int("model.n_head");
  c.d_model = config.get_int("model.d_model");
  c.n_ctx = config.get_int("model.n_ctx");
  c.d_ff = config.get_int("model.d_ff");
  if (c.d_ff == 0) c.d_ff = 4 * c.d_model;
  c.layer_norm_eps = config.get_number("model.layer_norm_eps");
  c.dropout = config.get_number("model.dropout");
  c.init_std = config.get_number("model.init_std");
  // bf16 (mixed precision) builds the model in f32; the trainer converts it (docs/cuda.md).
  c.dtype = config.get_string("train.dtype") == "f64" ? DType::f64 : DType::f32;
  c.activation_checkpointing = config.get_bool("train.activation_checkpointing");
  // train.recompute_modules is refused by the family's capabilities (nn/model_family.h check_capabilities).
  return c;
}

}  // namespace moetrain
