// GPT-2 exactly as MODEL_SPEC §2 (OpenAI GPT-2 / HF GPT2LMHeadModel): learned
// positions, pre-LayerNorm blocks, fused qkv projection, causal attention,
// GELU-tanh MLP, biases everywhere, final LayerNorm, LM head tied to wte.
// Weights are stored in nn.Linear layout [out, in]; Hugging Face's Conv1D
// layout [in, out] is produced on import/export (src/nn/gpt2_hf.h).
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "nn/parameters.h"

namespace moetrain {

class Config;

struct Gpt2Config {
  int64_t vocab_size = 50257;
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
  // From the model.* keys (and train.dtype, train.activation_checkpointing).
  static Gpt2Config from(const Config& config);
};

// Keys and values of the earlier positions, per layer, for decoding.
struct Gpt2Cache {
  std::vector<Tensor> k, v;  // per layer [B, length, H, head_dim]
  int64_t length = 0;
};

class Gpt2 {
 public:
  // GPT-2 init (seeded): linear weights and embeddings N(0, init_std), the two
  // residual output projections N(0, init_std / sqrt(2 n_layer)), biases 0, LayerNorm (1, 0).
  Gpt2(const Gpt2Config& config, uint64_t seed);

  // ids [B, T] (i32/i64/u16), T <= n_ctx -> logits [B, T, vocab_size].
  Tensor forward(const Tensor& ids, bool training = true);
  // Mean next-token cross-entropy of forward(ids) against targets [B, T].
  Tensor loss(const Tensor& ids, const Tensor& targets, bool training = true);
  // Appends ids [B, T] after the cached positions and returns their logits
  // [B, T, vocab_size]; records nothing (runs under NoGradGuard).
  Tensor forward_cached(const Tensor& ids, Gpt2Cache& cache);

  const Gpt2Config& config() const { return config_; }
  ParameterList& parameters() { return params_; }
  const ParameterList& parameters() const { return params_; }
  // Training FLOPs per token (forward + backward): 6 N + 6 L T D (llm.c's estimate).
  double flops_per_token(int64_t seq_len) const;

 private:
  struct Block {
    Tensor ln1_w, ln1_b, attn_w, attn_b, attn_proj_w, attn_proj_b, ln2_w, ln2_b, fc_w, fc_b, mlp_proj_w, mlp_proj_b;
  };
  Tensor embed(const Tensor& ids, int64_t first_position, bool training);
  Tensor block_forward(const Block& b, const Tensor& x, bool training, Tensor* k_cache, Tensor* v_cache);
  Tensor head(const Tensor& x);

  Gpt2Config config_;
  Tensor wte_, wpe_, lnf_w_, lnf_b_;
  std::vector<Block> blocks_;
  ParameterList params_;
};

}  // namespace moetrain
