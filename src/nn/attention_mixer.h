// Plain causal softmax attention as a hybrid-model mixer (the evolution ladder's
// GPT-2 rung and K3's full-attention alternative to MLA): q, k, v, o projections
// without biases (self_attn.{q,k,v,o}_proj.weight [D, D], HF names), H heads of
// D / H, scale 1/√(D/H), no positional encoding. Decoding caches every K and V.
#pragma once

#include "nn/mixer.h"

namespace moetrain {

struct QkClipSite;  // nn/language_model.h

struct AttentionMixerConfig {
  int64_t d_model = 256;
  int64_t n_head = 4;
  double init_std = 0.02;
};

struct AttentionCache : MixerCache {
  Tensor k, v;  // [B, L, H, D / H]
  int64_t bytes() const override { return k.defined() ? k.nbytes() + v.nbytes() : 0; }
};

class AttentionMixer : public Mixer {
 public:
  AttentionMixer(const AttentionMixerConfig& c, ParamFactory& factory, const std::string& prefix);

  MixerKind kind() const override { return MixerKind::attention; }
  Tensor forward(const Tensor& x, MixerCache* cache = nullptr) const override;
  std::unique_ptr<MixerCache> new_cache() const override { return std::make_unique<AttentionCache>(); }
  double sequence_flops_per_token(int64_t seq_len) const override;
  int64_t cache_bytes(int64_t length) const override;
  // QK-Clip's statistic, as MlaLayer::record_max_logits (nn/mla.h).
  void record_max_logits(QkClipSite* site) { site_ = site; }
  int64_t n_head() const { return c_.n_head; }

  Tensor q_proj, k_proj, v_proj, o_proj;

 private:
  AttentionMixerConfig c_;
  DType dtype_;
  QkClipSite* site_ = nullptr;
};

}  // namespace moetrain
