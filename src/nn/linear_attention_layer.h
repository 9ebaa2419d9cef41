// Linear-attention token mixer (Katharopoulos et al. 2020, "Transformers are
// RNNs"), the second rung of the evolution ladder (docs/evolution.md):
//   q, k, v = x W{q,k,v}^T                     W [H·K, D] (no bias, no conv)
//   φ(x)    = elu(x) + 1                       per head over [B, T, H, K]
//   S_t     = S_{t-1} + φ(k_t) v_t^T,  z_t = z_{t-1} + φ(k_t)      additive state, no decay
//   o_t     = S_t^T φ(q_t) / (z_t^T φ(q_t) + eps)
//   y       = o.reshape(B, T, H·K) Wo^T        Wo [D, H·K]
// S and z run through one linear_attention op (ops/linear_attention/linear_attention.h) on v with
// a column of ones appended: its last output column is the normaliser, the last
// state column is z. Value head dim = K.
#pragma once

#include <string>

#include "core/tensor.h"
#include "nn/mixer.h"
#include "nn/param_factory.h"

namespace moetrain {

struct LinearAttentionConfig {
  int64_t d_model = 256;
  int64_t n_head = 4;
  int64_t head_dim = 64;  // K = V
  double eps = 1e-6;      // added to the normaliser (φ > 0 keeps it positive anyway)
  bool chunked = true;    // chunked kernels; false: the token-by-token reference
  int64_t chunk_size = 64;
  double init_std = 0.02;
};

// Decoding state: [B, H, K, V + 1] (S with z as its last column). Constant in the length.
struct LinearAttentionCache : MixerCache {
  Tensor state;
  int64_t bytes() const override { return state.defined() ? state.nbytes() : 0; }
};

class LinearAttentionLayer : public Mixer {
 public:
  // prefix: e.g. "model.layers.0.self_attn."
  LinearAttentionLayer(const LinearAttentionConfig& c, ParamFactory& factory, const std::string& prefix);

  MixerKind kind() const override { return MixerKind::linear_attention; }
  // x [B, T, D] (the normed sublayer input) -> [B, T, D]; with a cache, continues from its state.
  Tensor forward(const Tensor& x, MixerCache* cache = nullptr) const override;
  std::unique_ptr<MixerCache> new_cache() const override { return std::make_unique<LinearAttentionCache>(); }
  // Counted as the delta rule's state update: ~ 24·K·K·H (forward + backward).
  double sequence_flops_per_token(int64_t seq_len) const override;
  // The state S and the normaliser z: constant in the length.
  int64_t cache_bytes(int64_t length) const override;

  const LinearAttentionConfig& config() const { return c_; }

  Tensor q_proj, k_proj, v_proj, o_proj;

 private:
  LinearAttentionConfig c_;
  DType dtype_;
};

// elu(x) + 1 = relu(x) + exp(−relu(−x)): x + 1 for x > 0, e^x otherwise; always > 0.
Tensor elu_plus_one(const Tensor& x);

}  // namespace moetrain
