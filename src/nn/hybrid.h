// The K3-style hybrid decoder (docs/model.md#block-attnres to #full-decoder): token embedding, a
// per-layer schedule of token mixers (nn/mixer.h: KDA docs/model.md#kda-layer, gated MLA
// docs/model.md#gated-mla, plain causal attention, and the ladder's DeltaNet, Gated DeltaNet
// and linear attention) each followed by an FFN (nn/ffn.h: dense SiTU-GLU / SwiGLU /
// GELU, or an MoE layer, nn/moe.h), RMSNorm pre-norms, and either Block Attention
// Residuals (docs/model.md#attnres-schedule: every sublayer input is a softmax-over-depth read of block
// sums) or the standard residual stream (Kimi-Linear), final RMSNorm, LM head
// (untied by default). Parameter names follow Hugging Face Kimi:
//   model.embed_tokens.weight, model.layers.{l}.{input_layernorm,post_attention_layernorm}.weight,
//   model.layers.{l}.self_attn.*, model.layers.{l}.mlp.*, model.layers.{l}.{attn,mlp}_res_{proj,norm}.weight,
//   model.output_attn_res_{proj,norm}.weight, model.norm.weight, lm_head.weight.
// Saved models use Kimi's exact names, which differ for MoE layers (block_sparse_moe.*,
// one experts.{j}.* per expert), AttnRes (self_attention_res_*) and some shapes
// (nn/hybrid_hf.h, docs/export.md).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "nn/ffn.h"
#include "nn/hybrid_layer.h"
#include "nn/kda_layer.h"
#include "nn/language_model.h"
#include "nn/mixer.h"
#include "nn/mla.h"
#include "nn/moe.h"
#include "nn/param_factory.h"

namespace moetrain {

class Config;

struct HybridConfig {
  int64_t vocab_size = 256;
  // The embedding table and LM head get vocab_size rounded up to a multiple of
  // this (model.vocab_pad_multiple; docs/model.md#padded-vocabulary). The padding
  // rows start at 0 and take no part in the loss, sampling or the HF export.
  int64_t vocab_pad_multiple = 1;
  int64_t d_model = 256;
  int64_t n_ctx = 1024;  // longest sequence accepted (no position embeddings; a sanity bound)
  std::vector<MixerKind> mixers;  // one per layer
  int64_t attention_n_head = 4;   // plain attention mixer
  KdaLayerConfig kda;             // also deltanet, gated_deltanet (their decay set per layer) and the
                                  // heads, head dim and kernels of linear_attention
  MlaConfig mla;
  FfnConfig ffn;  // the dense FFN
  MoeConfig moe;
  bool attn_res = true;
  int64_t attn_res_block_size = 12;  // S, in decoder layers: a block opens at l % S == 0
  bool tie_embeddings = false;
  double rms_norm_eps = 1e-5;
  double init_std = 0.02;
  double embed_init_std = 1.0;
  DType dtype = DType::f32;
  // train.activation_checkpointing: each layer's activations recomputed in backward
  // (docs/training.md#activation-recomputation); the gradients are those without, bit for bit.
  bool recompute = false;

  int64_t n_layer() const { return static_cast<int64_t>(mixers.size()); }
  int64_t padded_vocab_size() const { return (vocab_size + vocab_pad_multiple - 1) / vocab_pad_multiple * vocab_pad_multiple; }
  bool is_moe_layer(int64_t l) const { return moe.num_experts > 0 && l >= moe.first_dense_layers; }
  // From the model.* keys; errors name the key (Config::fail).
  static HybridConfig from(const Config& config);
};

// The mixer schedule: an explicit comma list ("kda,kda,kda,mla"), or `mixer`
// everywhere except `attn_mixer` at layers l % every == offset and (if last) the last one.
std::vector<MixerKind> mixer_schedule(int64_t n_layer, const std::string& explicit_list, MixerKind mixer,
                                      MixerKind attn_mixer, int64_t every, int64_t offset, bool last);

class HybridModel : public LanguageModel {
 public:
  // allocate = false builds shapes only (for the ledger): no tensor is created.
  // shard: this rank's experts under expert parallelism (MoE layers).
  // stage: pipeline parallelism (nn/pipeline_stages.h): only this stage's
  // parameters are made (the first stage's embedding; the last stage's final
  // AttnRes read, norm and head, and with tied embeddings its own copy of the
  // table); the others are declared to keep the generator's sequence, so every
  // parameter has the value it has in the whole model of the same seed.
  // A padded vocabulary's embedding and head rows past vocab_size are 0; the
  // others, and every other parameter, are those of the unpadded model of the same seed.
  // With virtual stages (stage.chunks > 1) it holds each of its chunks' layers.
  HybridModel(const HybridConfig& config, uint64_t seed, bool allocate = true, ExpertShard shard = {},
              PipelineStage stage = {});
  ~HybridModel() override;

  std::string arch() const override { return "hybrid"; }
  std::string describe() const override;
  int64_t vocab_size() const override { return c_.vocab_size; }
  int64_t padded_vocab_size() const override { return c_.padded_vocab_size(); }
  int64_t max_positions() const override { return c_.n_ctx; }
  DType dtype() const override { return c_.dtype; }
  int64_t hidden_size() const override { return c_.d_model; }
  PipelineStage pipeline_stage() const override { return stage_; }
  // What crosses the boundary before the chunk's first layer: with AttnRes the
  // completed block sums (ceil(first / S) of them, the embedding the first) and
  // the running sum of the open block; without, the residual stream.
  int64_t stage_input_count(int64_t chunk = 0) const override;
  StageOutput stage_forward(const Tensor& ids, const Tensors& inputs, const Tensor& targets, bool training,
                            int64_t chunk = 0) override;
  bool stage_holds(const std::string& name) const override;
  StageLayers pipeline_stage_layers(int64_t chunk = 0) const override;

  // ids -> logits [B, T, vocab_size] (the padding columns of a padded vocabulary cut off).
  Tensor forward(const Tensor& ids, bool training = true) override;
  // ids -> logits [B, T, padded_vocab_size()]: the head's output as it is (the loss's input).
  Tensor forward_padded(const Tensor& ids, bool training = true) override;
  // Cross-entropy plus the MoE layers' auxiliary losses (when their weights are > 0).
  Tensor loss(const Tensor& ids, const Tensor& targets, bool training = true) override;
  std::unique_ptr<DecodeCache> new_cache() const override;
  Tensor forward_cached(const Tensor& ids, DecodeCache& cache) override;

  ParameterList& parameters() override { return factory_.params(); }
  ParameterList buffers() const override { return factory_.buffers(); }
  std::vector<MoeLayer*> moe_layers() const override;
  void set_expert_group(comm::Communicator* group) override;
  // One site per MLA (layout mla) or attention (separate_qk) layer of this stage,
  // label "layers.<l>"; KDA and the other linear mixers have none.
  void set_track_max_logits(bool on) override;
  std::vector<QkClipSite*> qk_clip_sites() override;
  // The mixer of layer l.
  const Mixer& mixer(int64_t l) const;
  const std::vector<ParamSpec>& param_specs() const { return factory_.specs(); }
  double flops_per_token(int64_t seq_len) const override;
  double activation_bytes_per_token(bool mixed_precision) const override;
  int64_t decode_cache_bytes(int64_t length) const override;
  // The two estimates above for the layers [first, end) of a pipeline stage
  // (nn/pipeline_stages.h), with or without what follows the last layer (output
  // AttnRes read, final norm, LM head, logits); over all layers with the head they
  // are the whole-model numbers.
  double flops_per_token(int64_t seq_len, int64_t first, int64_t end, bool head) const;
  // The forward FLOPs per token that train.recompute_modules runs again in backward over
  // layers [first, end): act the down-projections (dense FFN, shared and routed experts),
  // experts the routed experts' three matrices (2 per weight element a token meets).
  double selective_recompute_flops_per_token(int64_t first, int64_t end) const;
  double activation_bytes_per_token(bool mixed_precision, int64_t first, int64_t end, bool head) const;
  // Values per token that flow from layer - 1 into layer `layer` (what a pipeline
  // stage starting there receives, and the gradient it sends back): the AttnRes
  // block list so far plus the hidden state, D each; D without AttnRes.
  int64_t boundary_values_per_token(int64_t layer) const;
  // The decoder layer a parameter belongs to (model.layers.<l>.*); -1 for those before
  // the layers (the embedding), n_layer for those after (final norm, output AttnRes, LM head).
  int64_t parameter_layer(const std::string& name) const;
  const HybridConfig& config() const { return c_; }
  std::unique_ptr<HfAdapter> hf_adapter() const override;  // nn/hybrid_hf.cpp

 private:
  Tensor run(const Tensor& ids, DecodeCache* cache, bool training);
  // Layers [first, end) on the state (AttnRes block sums then the open block's
  // running sum; or the residual stream): the state after them.
  Tensors run_layers(Tensors state, int64_t first, int64_t end, DecodeCache* cache, bool training);
  // The final AttnRes read, norm and LM head on the state after the last layer.
  Tensor head(const Tensors& state);                   // [B, T, padded_vocab_size()]
  Tensor without_padding(const Tensor& logits) const;  // [B, T, vocab_size]

  HybridConfig c_;
  ParamFactory factory_;
  Tensor embed_tokens_, norm_, lm_head_, out_res_proj_, out_res_norm_;
  std::vector<std::unique_ptr<HybridLayer>> layers_;  // all n_layer; only the chunks' have tensors
  std::unique_ptr<ResidualStream> stream_;             // PlainResidual or BlockAttnRes
  Tensors aux_losses_;  // the MoE layers' auxiliary losses of the last forward, in layer order
  PipelineStage stage_;
  std::vector<StageLayers> chunks_;  // this rank's layers: one range per chunk (one for the whole model)
  bool holds_layer(int64_t l) const;
};

}  // namespace moetrain
