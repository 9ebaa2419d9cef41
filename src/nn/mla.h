// Gated multi-head latent attention (docs/model.md#gated-mla, K3 `KimiMLAAttention`),
// Hugging Face parameter names:
//   cq      = RMSNorm(x Wqa^T)                 q_a_proj [r_q, D], q_a_layernorm   (no LoRA: q_proj [H(dn+dr), D])
//   q       = cq Wqb^T -> [B,T,H, dn+dr]        q_b_proj; per head [q_nope | q_rot]
//   [c, kr] = x Wkva^T                          kv_a_proj_with_mqa [r_kv + dr, D]
//   kv      = RMSNorm(c) Wkvb^T -> [B,T,H, dn+dv]   kv_a_layernorm, kv_b_proj; per head [k_nope | v]
//   k       = [k_nope | kr shared by all heads]
//   o       = causal softmax(q k^T (dn+dr)^{-1/2}) v
//   y       = (o ⊙ σ(x Wg^T)) Wo^T              g_proj [H dv, D] (output gate), o_proj [D, H dv]
// NoPE by default; optional RoPE (rotate-half, docs/model.md#rope) on q_rot and kr.
// The decoding cache holds the normed latent c and kr: (r_kv + dr) per token.
#pragma once

#include <string>

#include "core/tensor.h"
#include "nn/mixer.h"
#include "nn/param_factory.h"

namespace moetrain {

struct QkClipSite;  // nn/language_model.h

struct MlaConfig {
  int64_t d_model = 256;
  int64_t n_head = 4;
  int64_t q_lora_rank = 128;  // 0: no query LoRA (Kimi-Linear)
  int64_t kv_lora_rank = 64;
  int64_t qk_nope_head_dim = 64;
  int64_t qk_rope_head_dim = 32;
  int64_t v_head_dim = 64;
  bool output_gate = true;
  bool rope = false;
  double rope_theta = 10000.0;
  double lora_norm_eps = 1e-6;
  double init_std = 0.02;
};

struct MlaCache : MixerCache {
  Tensor c;   // [B, L, r_kv], normed latent
  Tensor kr;  // [B, L, dr]
  int64_t length() const { return c.defined() ? c.size(1) : 0; }
  int64_t bytes() const override { return (c.defined() ? c.nbytes() : 0) + (kr.defined() ? kr.nbytes() : 0); }
};

class MlaLayer : public Mixer {
 public:
  MlaLayer(const MlaConfig& c, ParamFactory& factory, const std::string& prefix);
  MixerKind kind() const override { return MixerKind::mla; }
  // x [B, T, D] (normed sublayer input) -> [B, T, D]; with an MlaCache, appends to it.
  Tensor forward(const Tensor& x, MixerCache* cache = nullptr) const override;
  std::unique_ptr<MixerCache> new_cache() const override { return std::make_unique<MlaCache>(); }
  // Causal attention over H heads of dq + dv: 3·T·H·(dq + dv) (forward + backward, half masked).
  double sequence_flops_per_token(int64_t seq_len) const override;
  // The latent and the shared RoPE key of every token: linear in the length.
  int64_t cache_bytes(int64_t length) const override;
  const MlaConfig& config() const { return c_; }
  // QK-Clip's statistic (docs/model.md#qk-clip): while site is non-null, every
  // forward with grad mode on folds its heads' max logits into site->max_logit
  // (fold_max_logit, nn/language_model.h); nullptr stops recording.
  void record_max_logits(QkClipSite* site) { site_ = site; }

  Tensor q_proj, q_a_proj, q_a_layernorm, q_b_proj, kv_a_proj, kv_a_layernorm, kv_b_proj, g_proj, o_proj;

 private:
  MlaConfig c_;
  DType dtype_;
  QkClipSite* site_ = nullptr;
};

// Rotate-half RoPE (docs/model.md#rope) of x [B, T, N, r] at positions first..first+T−1.
Tensor rope(const Tensor& x, int64_t first_position, double theta);

}  // namespace moetrain
