// GPT-2 exactly as docs/model.md#gpt-2-block (OpenAI GPT-2 / HF GPT2LMHeadModel): learned
// positions, pre-LayerNorm blocks, fused qkv projection, causal attention,
// GELU-tanh MLP, biases everywhere, final LayerNorm, LM head tied to wte.
// Weights are stored in nn.Linear layout [out, in]; Hugging Face's Conv1D
// layout [in, out] is produced on import/export (src/nn/gpt2_hf.h).
#pragma once

#include <cstdint>
#include <vector>

#include "core/grad_mode.h"
#include "core/tensor.h"
#include "nn/language_model.h"
#include "nn/param_factory.h"
#include "nn/parameters.h"

namespace moetrain {

class Config;

struct Gpt2Config {
  int64_t vocab_size = 50257;
  // wte's rows (and the head's columns): vocab_size rounded up to a multiple of
  // this (model.vocab_pad_multiple; docs/model.md#padded-vocabulary). The padding
  // rows start at zero and stay there: they are outside the loss's softmax, never
  // sampled, and not exported.
  int64_t vocab_pad_multiple = 1;
  int64_t n_layer = 12;
  int64_t n_head = 12;
  int64_t d_model = 768;
  int64_t n_ctx = 1024;
  int64_t d_ff = 3072;
  double layer_norm_eps = 1e-5;
  double dropout = 0.0;  // on embeddings and both residual branches (not on attention probabilities)
  double init_std = 0.02;
  DType dtype = DType::f32;
  bool activation_checkpointing = false;

  int64_t head_dim() const { return d_model / n_head; }
  int64_t padded_vocab_size() const { return (vocab_size + vocab_pad_multiple - 1) / vocab_pad_multiple * vocab_pad_multiple; }
  // From the model.* keys (and train.dtype, train.activation_checkpointing).
  static Gpt2Config from(const Config& config);
};

// One block's weights, nn.Linear layout [out, in].
struct Gpt2BlockWeights {
  Tensor ln1_w, ln1_b, attn_w, attn_b, attn_proj_w, attn_proj_b, ln2_w, ln2_b, fc_w, fc_b, mlp_proj_w, mlp_proj_b;
};

// One GPT-2 block (docs/model.md#gpt-2-block) on x [B, T, D] with n_head heads:
//   h = x + dropout(attn(LN_1(x)) W_proj^T + b),  y = h + dropout(gelu(LN_2(h) W_fc^T + b_fc) W_proj^T + b_proj).
// With caches: keys and values are appended to *k_cache / *v_cache ([B, length, H, hd],
// undefined at first) and attention runs over all of them. With a QK-Clip site, the
// block folds its heads' max logits into site->max_logit (fold_max_logit,
// nn/language_model.h; Gpt2 passes one in training forwards).
Tensor gpt2_block(const Gpt2BlockWeights& w, const Tensor& x, int64_t n_head, double layer_norm_eps,
                  double dropout_p, Tensor* k_cache = nullptr, Tensor* v_cache = nullptr, QkClipSite* site = nullptr);

// The block without its last residual add, for a caller that fuses that add with
// the next LayerNorm (add_layer_norm): given ln1 = LN_1(x), returns h and the MLP
// branch, y = h + mlp_delta. LN_2(h) is fused with h = x + attn here.
struct Gpt2BlockParts {
  Tensor h, mlp_delta;
};
Gpt2BlockParts gpt2_block_parts(const Gpt2BlockWeights& w, const Tensor& x, const Tensor& ln1, int64_t n_head,
                                double layer_norm_eps, double dropout_p, Tensor* k_cache = nullptr,
                                Tensor* v_cache = nullptr, QkClipSite* site = nullptr);

// Keys and values of the earlier positions, per layer, for decoding.
struct Gpt2Cache : DecodeCache {
  std::vector<Tensor> k, v;  // per layer [B, length, H, head_dim]
  int64_t tokens = 0;
  int64_t length() const override { return tokens; }
  int64_t bytes() const override;
};

class Gpt2 : public LanguageModel {
 public:
  // GPT-2 init (seeded): linear weights and embeddings N(0, init_std), the two
  // residual output projections N(0, init_std / sqrt(2 n_layer)), biases 0, LayerNorm (1, 0).
  // A padded vocabulary's wte rows past vocab_size are 0; the others, and every
  // other parameter, are those of the unpadded model of the same seed.
  // allocate = false: shapes only (the ledger); the model cannot run.
  Gpt2(const Gpt2Config& config, uint64_t seed, bool allocate = true);

  std::string arch() const override { return "gpt2"; }
  std::string describe() const override;
  int64_t vocab_size() const override { return config_.vocab_size; }
  int64_t padded_vocab_size() const override { return config_.padded_vocab_size(); }
  int64_t max_positions() const override { return config_.n_ctx; }
  DType dtype() const override { return config_.dtype; }
  int64_t hidden_size() const override { return config_.d_model; }

  // ids [B, T] (i32/i64/u16), T <= n_ctx -> logits [B, T, vocab_size] (the padding
  // columns of a padded vocabulary cut off).
  Tensor forward(const Tensor& ids, bool training = true) override;
  // ids -> logits [B, T, padded_vocab_size()]: the head's output as it is (the loss's input).
  Tensor forward_padded(const Tensor& ids, bool training = true) override;
  // Appends ids [B, T] after the cached positions and returns their logits
  // [B, T, vocab_size]; records nothing (runs under NoGradGuard).
  Tensor forward_cached(const Tensor& ids, Gpt2Cache& cache);
  Tensor forward_cached(const Tensor& ids, DecodeCache& cache) override;
  std::unique_ptr<DecodeCache> new_cache() const override { return std::make_unique<Gpt2Cache>(); }

  const Gpt2Config& config() const { return config_; }
  ParameterList& parameters() override { return factory_.params(); }
  const ParameterList& parameters() const { return factory_.params(); }
  const std::vector<ParamSpec>& param_specs() const { return factory_.specs(); }
  // Training FLOPs per token (forward + backward): 6 N + 6 L T D (llm.c's estimate).
  double flops_per_token(int64_t seq_len) const override;
  // LN inputs/outputs, qkv and its split, attention output, MLP hidden before and
  // after GELU (~13 D + 2 F per layer), plus logits and their gradient (2 V).
  double activation_bytes_per_token(bool mixed_precision) const override;
  int64_t decode_cache_bytes(int64_t length) const override;
  // The two estimates above for the blocks [first, end) of a pipeline stage
  // (nn/pipeline_stages.h), with or without the head (ln_f, the tied wte and the
  // logits; wpe goes with block 0); over all blocks with the head, the whole model.
  double flops_per_token(int64_t seq_len, int64_t first, int64_t end, bool head) const;
  double activation_bytes_per_token(bool mixed_precision, int64_t first, int64_t end, bool head) const;
  // Values per token passed from block - 1 to block `layer`: the residual stream, D.
  int64_t boundary_values_per_token(int64_t) const { return config_.d_model; }
  // The block a parameter belongs to (h.<l>.*); -1 for wte and wpe, n_layer for ln_f.
  int64_t parameter_layer(const std::string& name) const;
  std::unique_ptr<HfAdapter> hf_adapter() const override;  // nn/gpt2_hf.cpp
  // One site per block: fused_qkv, h.<l>.attn.c_attn.weight and .bias, label "layers.<l>".
  void set_track_max_logits(bool on) override { track_max_logits_ = on; }
  std::vector<QkClipSite*> qk_clip_sites() override;

 private:
  using Block = Gpt2BlockWeights;
  Tensor embed(const Tensor& ids, int64_t first_position, bool training);
  Tensor block_forward(const Block& b, const Tensor& x, bool training, Tensor* k_cache, Tensor* v_cache,
                       QkClipSite* site);
  // Whether this forward records max logits: tracking on and grad mode on (a training forward).
  bool recording() const { return track_max_logits_ && autograd::grad_enabled(); }
  Tensor blocks_then_final_norm(Tensor x, bool training, Gpt2Cache* cache);
  Tensor head(const Tensor& final_normed);              // [B, T, padded_vocab_size()]
  Tensor without_padding(const Tensor& logits) const;  // [B, T, vocab_size]

  Gpt2Config config_;
  Tensor wte_, wpe_, lnf_w_, lnf_b_;
  std::vector<Block> blocks_;
  ParamFactory factory_;
  std::vector<QkClipSite> sites_;  // one per block, made once (the pointers handed out stay valid)
  bool track_max_logits_ = false;
};

}  // namespace moetrain
