#include "nn/attention_mixer.h"

#include <cmath>

#include "nn/language_model.h"
#include "ops/attention/attention.h"
#include "ops/linalg/linalg.h"
#include "ops/view/view.h"

namespace moetrain {

AttentionMixer::AttentionMixer(const AttentionMixerConfig& c, ParamFactory& f, const std::string& p)
    : c_(c), dtype_(f.dtype()) {
  const int64_t D = c.d_model;
  MT_CHECK(c.n_head >= 1 && D % c.n_head == 0, "hybrid model: d_model = {} is not divisible by the {} attention heads",
           D, c.n_head);
  const Init w = Init::trunc_normal(c.init_std);
  q_proj = f.make(p + "q_proj.weight", {D, D}, w, "attention", true);
  k_proj = f.make(p + "k_proj.weight", {D, D}, w, "attention", true);
  v_proj = f.make(p + "v_proj.weight", {D, D}, w, "attention", true);
  o_proj = f.make(p + "o_proj.weight", {D, D}, w, "attention", true);
}

Tensor AttentionMixer::forward(const Tensor& x, MixerCache* mixer_cache) const {
  AttentionCache* cache = cache_as<AttentionCache>(mixer_cache, "attention");
  const int64_t B = x.size(0), T = x.size(1), H = c_.n_head, hd = c_.d_model / H;
  Tensor q = reshape(linear(x, q_proj), {B, T, H, hd});
  Tensor k = reshape(linear(x, k_proj), {B, T, H, hd});
  Tensor v = reshape(linear(x, v_proj), {B, T, H, hd});
  if (cache) {
    if (cache->k.defined()) {
      k = concat({cache->k, k}, 1);
      v = concat({cache->v, v}, 1);
    }
    cache->k = k.detach();
    cache->v = v.detach();
  }
  Tensor max_logit;  // [H], when QK-Clip records (nn/language_model.h)
  const bool record = wants_max_logit(site_);
  Tensor o = causal_attention(q, k, v, 1.0 / std::sqrt(static_cast<double>(hd)), record ? &max_logit : nullptr);
  if (record) fold_max_logit(*site_, max_logit);
  return linear(reshape(o, {B, T, c_.d_model}), o_proj);
}

// Causal attention 3·T·H·(dq + dv) = 6·T·D (forward + backward, half the scores masked).
double AttentionMixer::sequence_flops_per_token(int64_t T) const {
  return 6.0 * static_cast<double>(T) * static_cast<double>(c_.d_model);
}

int64_t AttentionMixer::cache_bytes(int64_t length) const { return 2 * length * c_.d_model * dtype_size(dtype_); }

}  // namespace moetrain
