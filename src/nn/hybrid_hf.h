// The Hugging Face adapter of the hybrid (nn/hf_adapter.h, docs/export.md#the-hybrid):
// Moonshot's Kimi-Linear / Kimi-K3 tensor names (model.layers.{l}.self_attn.*,
// block_sparse_moe.* with one experts.{j}.w1/w2/w3 per expert, self_attention_res_*),
// config.json in both directions, import and export of weights, and the layer loaders
// of `moetrain op` (layer configs worked out from HF shapes).
//
// model_type: "kimi_linear" when transformers' KimiLinearForCausalLM (5.x) computes the
// model exactly, else "moetrain_hybrid" (same names and fields, plus the "moetrain" block;
// transformers has no class for it) with a one-line notice naming the features
// (hybrid_features_outside_kimi_linear). Two features are mapped rather than refused:
// tied embeddings (lm_head.weight written as a copy of embed_tokens: transformers'
// class never ties) and top_k = 1 (moetrain follows DeepSeek-V3 / Moonshot: a single
// expert's weight is rho * s, not renormalised to rho; config.json says
// moe_renormalize false, which makes transformers compute the same).
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "nn/hf_adapter.h"
#include "nn/hybrid.h"
#include "nn/param_factory.h"

namespace moetrain {

// ------------------------------------------------------------------ config.json

// What of `c` transformers' KimiLinearForCausalLM does not compute, one phrase each
// ("MLA output gate", "Block AttnRes", ...); empty: exported as kimi_linear.
std::vector<std::string> hybrid_features_outside_kimi_linear(const HybridConfig& c);
// The config.json text of `c` (KimiLinearConfig's fields, the "moetrain" block);
// dtype: the exported weights' (f32 or bf16).
std::string hybrid_hf_config_json(const HybridConfig& c, DType dtype);
// The architecture of a kimi_linear or moetrain_hybrid config.json (`path` for
// messages; training-only fields keep `base`'s values). kimi_linear is read as
// transformers' class computes it (softplus gate, low-rank output gate, no MLA gate or
// RoPE, SwiGLU, sigmoid router, untied head, layer_types / mlp_layer_types or their
// Kimi spellings, transformers' or Moonshot's field names); what that class cannot be
// made to compute by moetrain is refused (Error naming the file and the field):
// num_key_value_heads != num_attention_heads, hidden_act other than silu, attention
// biases, top_k = 1 with renormalisation (transformers' weight 1 * rho), MoE layers not
// forming one block after the dense ones, fields of the "moetrain" block that
// contradict kimi_linear.
HybridConfig read_hybrid_hf_config(const std::string& path, HybridConfig base = {});
// The config keys whose HybridConfig::from gives `c`'s architecture: model.arch hybrid,
// model.layer_mixers, and the model.* keys of the mixers, FFN, MoE, AttnRes and head.
HfArchitecture hybrid_hf_architecture(const HybridConfig& c);

// ------------------------------------------------------------------ name table

// One tensor of the HF layout as it relates to a model tensor: HF name and shape; row >= 0
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

// The tensors of `state` under HF names and layouts, in model order (experts split);
// lm_head.weight as a copy of the embedding when the state has none (tied).
// vocab_size >= 0 with more rows in the embedding or head (a padded vocabulary,
// docs/model.md#padded-vocabulary): those cut to their first vocab_size rows.
std::vector<std::pair<std::string, Tensor>> hybrid_hf_tensors(const ParameterList& state, int64_t vocab_size = -1);

// Copies HF-named hybrid weights into `state` (parameters and buffers, converted to their
// dtypes; experts assembled from experts.{j}.*). Strict: every tensor of `state` must be
// present with its shape, and nothing else (errors name the file and the tensor), except:
// layer 0's unused AttnRes pair of K3 checkpoints is ignored; transformers' save format
// (a dense layer's MLP under block_sparse_moe.) is read; a tied model accepts
// lm_head.weight when it equals the embedding. Files written before the export existed
// (moetrain's internal names: stacked experts mlp.experts.w1.weight [E, F, L]) are
// accepted too when they hold exactly `state`'s names.
// shard: the routed-expert tensors of `state` (group "experts", [E / size, ...]) hold
// global experts [index * E / size, (index + 1) * E / size) (expert parallelism); the
// file's other experts are checked for shape and skipped.
// vocab_size >= 0 with an embedding or head of more rows (a padded vocabulary,
// docs/model.md#padded-vocabulary): the file's have vocab_size rows, copied into the
// first ones; the rest are set to 0.
void load_hybrid_hf_weights(ParameterList& state, const HfTensorSource& weights, ExpertShard shard = {},
                            int64_t vocab_size = -1);

class HybridHfAdapter : public HfAdapter {
 public:
  explicit HybridHfAdapter(HybridConfig c) : c_(std::move(c)) {}
  std::string model_type() const override;
  std::vector<std::string> features_outside_hf() const override { return hybrid_features_outside_kimi_linear(c_); }
  std::string config_json(DType dtype) const override { return hybrid_hf_config_json(c_, dtype); }
  std::vector<std::pair<std::string, Tensor>> export_tensors(const ParameterList& state) const override {
    return hybrid_hf_tensors(state, c_.vocab_size);
  }
  // A_log, dt_bias and the router bias (Kimi creates them in f32).
  bool keeps_f32(const std::string& hf_name) const override;
  void import_weights(ParameterList& state, const HfTensorSource& source, ExpertShard shard) const override {
    load_hybrid_hf_weights(state, source, shard, c_.vocab_size);
  }

 private:
  HybridConfig c_;
};

// ------------------------------------------------------------------ single layers
// One layer's weights under their HF names without the layer prefix ("q_proj.weight",
// "experts.3.w1.weight"), as under `moetrain op`'s params/ (docs/op.md). The configs
// take from `base` what shapes do not say (heads of MLA, top_k, gates, epsilons) and
// fill in the rest from the shapes; errors name the tensor (source.where()).

// KimiDeltaAttention (kda_layer): H, HV, K, conv size, full-rank or low-rank output gate.
KdaLayerConfig hf_kda_layer_config(const HfTensorSource& w, int64_t d_model, KdaLayerConfig base);
// KimiMLAAttention (mla): base.n_head given; query LoRA, ranks, head dims, output gate.
MlaConfig hf_mla_config(const HfTensorSource& w, int64_t d_model, MlaConfig base);
// The MoE block (latent_moe): base.top_k given; E, F, latent width, shared experts.
MoeConfig hf_moe_config(const HfTensorSource& w, int64_t d_model, MoeConfig base);
// The supplier of a ParamFactory (param_factory.h, binding) that builds one layer
// (prefix "") from `w`: each parameter is its HF tensor reshaped, or its experts
// concatenated, differentiably, so the gradients reach the source's tensors in their
// own shapes (which the configs above checked: HF's, or the model's own such as a conv
// weight [P, W] instead of [P, 1, W]). Buffers come from read_buffer(); a router bias
// the source lacks is zeros. moe: the layer is an MoE block. `w` must outlive the
// construction of the layer.
ParamFactory::Supplier hf_layer_supplier(const HfTensorSource& w, bool moe);

}  // namespace moetrain
