// Linear-attention layer forward (nn/linear_attention_layer.h). Built from
// gradient-checked ops; the recurrence is the linear_attention op.
#include "nn/linear_attention_layer.h"

#include "core/grad_mode.h"
#include "ops/elementwise/elementwise.h"
#include "ops/linalg/linalg.h"
#include "ops/linear_attention/linear_attention.h"
#include "ops/view/view.h"

namespace moetrain {

Tensor elu_plus_one(const Tensor& x) { return add(relu(x), exp(neg(relu(neg(x))))); }

LinearAttentionLayer::LinearAttentionLayer(const LinearAttentionConfig& c, ParamFactory& f, const std::string& p)
    : c_(c), dtype_(f.dtype()) {
  MT_CHECK(c.n_head >= 1 && c.head_dim >= 1, "linear attention layer {}: n_head = {} and head_dim = {} must be >= 1",
           p, c.n_head, c.head_dim);
  const int64_t D = c.d_model, P = c.n_head * c.head_dim;
  const Init w = Init::trunc_normal(c.init_std);
  q_proj = f.make(p + "q_proj.weight", {P, D}, w, "linear_attn", true);
  k_proj = f.make(p + "k_proj.weight", {P, D}, w, "linear_attn", true);
  v_proj = f.make(p + "v_proj.weight", {P, D}, w, "linear_attn", true);
  o_proj = f.make(p + "o_proj.weight", {D, P}, w, "linear_attn", true);
}

double LinearAttentionLayer::sequence_flops_per_token(int64_t) const {
  return 24.0 * static_cast<double>(c_.head_dim * c_.head_dim * c_.n_head);
}

int64_t LinearAttentionLayer::cache_bytes(int64_t) const {
  return c_.n_head * c_.head_dim * (c_.head_dim + 1) * dtype_size(dtype_);  // S and z
}

Tensor LinearAttentionLayer::forward(const Tensor& x, MixerCache* mixer_cache) const {
  LinearAttentionCache* cache = cache_as<LinearAttentionCache>(mixer_cache, "linear attention");
  MT_CHECK(x.dim() == 3 && x.size(2) == c_.d_model, "linear attention layer: x is {} but must be [B, T, {}]",
           x.shape(), c_.d_model);
  const int64_t B = x.size(0), T = x.size(1), H = c_.n_head, K = c_.head_dim;
  Tensor q = elu_plus_one(reshape(linear(x, q_proj), {B, T, H, K}));
  Tensor k = elu_plus_one(reshape(linear(x, k_proj), {B, T, H, K}));
  Tensor v = concat({reshape(linear(x, v_proj), {B, T, H, K}), ones({B, T, H, 1}, x.dtype(), x.device())}, 3);  // [B,T,H,K+1]
  Tensor o;  // [B, T, H, K + 1]: numerator | normaliser
  if (cache && T == 1 && !autograd::grad_enabled()) {
    if (!cache->state.defined()) cache->state = zeros({B, H, K, K + 1}, x.dtype(), x.device());
    o = linear_attention_decode_step(q, k, v, cache->state);
  } else {
    Tensor h0 = cache ? cache->state : Tensor();
    LinearAttentionResult r = linear_attention(q, k, v, h0, c_.chunked, c_.chunk_size);
    if (cache) cache->state = r.final_state.detach().clone();  // owned: decode steps update it in place
    o = r.o;
  }
  Tensor y = div(slice(o, 3, 0, K), add_scalar(slice(o, 3, K, K + 1), c_.eps));
  return linear(reshape(y, {B, T, H * K}), o_proj);
}

}  // namespace moetrain
