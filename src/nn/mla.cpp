// Gated MLA forward (docs/model.md#gated-mla), from gradient-checked ops.
#include "nn/mla.h"

#include <cmath>
#include <deque>

#include "core/graph_capture.h"
#include "nn/language_model.h"
#include "ops/attention/attention.h"
#include "ops/elementwise/elementwise.h"
#include "ops/elementwise/sigmoid_gate.h"
#include "ops/linalg/linalg.h"
#include "ops/norm/norm.h"
#include "ops/view/view.h"

namespace moetrain {

MlaLayer::MlaLayer(const MlaConfig& c, ParamFactory& f, const std::string& p) : c_(c), dtype_(f.dtype()) {
  MT_CHECK(!c.rope || c.qk_rope_head_dim % 2 == 0, "mla {}: RoPE needs an even qk_rope_head_dim, got {}", p,
           c.qk_rope_head_dim);
  const int64_t D = c.d_model, H = c.n_head, dq = c.qk_nope_head_dim + c.qk_rope_head_dim;
  const Init w = Init::trunc_normal(c.init_std);
  if (c.q_lora_rank > 0) {
    q_a_proj = f.make(p + "q_a_proj.weight", {c.q_lora_rank, D}, w, "mla", true);
    q_a_layernorm = f.make(p + "q_a_layernorm.weight", {c.q_lora_rank}, Init::ones(), "norm", false);
    q_b_proj = f.make(p + "q_b_proj.weight", {H * dq, c.q_lora_rank}, w, "mla", true);
  } else {
    q_proj = f.make(p + "q_proj.weight", {H * dq, D}, w, "mla", true);
  }
  kv_a_proj = f.make(p + "kv_a_proj_with_mqa.weight", {c.kv_lora_rank + c.qk_rope_head_dim, D}, w, "mla", true);
  kv_a_layernorm = f.make(p + "kv_a_layernorm.weight", {c.kv_lora_rank}, Init::ones(), "norm", false);
  kv_b_proj = f.make(p + "kv_b_proj.weight", {H * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank}, w, "mla",
                     true);
  if (c.output_gate) g_proj = f.make(p + "g_proj.weight", {H * c.v_head_dim, D}, w, "mla", true);
  o_proj = f.make(p + "o_proj.weight", {D, H * c.v_head_dim}, w, "mla", true);
}

namespace {

// cos and sin of the rotation angles, [T, 1, r] each in x's dtype where x is. Kept
// for the last few (positions, width, theta, dtype, device) asked for: a training
// step asks for the same ones every layer and step, and a CUDA graph's replay reads
// the kept tensors (building them uploads from the host, which a capture refuses).
// Decoding asks for a new first position each token: those are kept too, the oldest
// dropped past kRopeTables.
struct RopeKey {
  int64_t first, T, r;
  double theta;
  DType dtype;
  Device device;
  bool operator==(const RopeKey&) const = default;
};
struct RopeTables {
  RopeKey key;
  Tensor cs, sn;
};
constexpr size_t kRopeTables = 16;

const RopeTables& rope_tables(const RopeKey& key) {
  static thread_local std::deque<RopeTables> kept;
  for (const RopeTables& t : kept)
    if (t.key == key) return t;
  const int64_t T = key.T, r = key.r, half = r / 2;
  Tensor cs = empty({T, 1, r}, DType::f64), sn = empty({T, 1, r}, DType::f64);
  double* pc = cs.data<double>();
  double* ps = sn.data<double>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < half; ++i) {
      double ang = static_cast<double>(key.first + t) *
                   std::pow(key.theta, -2.0 * static_cast<double>(i) / static_cast<double>(r));
      pc[t * r + i] = pc[t * r + i + half] = std::cos(ang);
      ps[t * r + i] = ps[t * r + i + half] = std::sin(ang);
    }
  if (kept.size() == kRopeTables) kept.pop_front();
  kept.push_back({key, cs.to(key.dtype).to(key.device), sn.to(key.dtype).to(key.device)});
  return kept.back();
}

}  // namespace

Tensor rope(const Tensor& x, int64_t first, double theta) {
  const int64_t half = x.size(-1) / 2;
  const RopeTables& t = rope_tables({first, x.size(1), x.size(-1), theta, x.dtype(), x.device()});
  // A CUDA graph reads the tables where they are: they live as long as it, evicted or not.
  graph::keep(t.cs.impl_ptr());
  graph::keep(t.sn.impl_ptr());
  Tensors halves = split(x, {half, half}, -1);
  Tensor rotated = concat({neg(halves[1]), halves[0]}, -1);  // rotate_half([x1, x2]) = [-x2, x1]
  return add(mul(x, t.cs), mul(rotated, t.sn));
}

double MlaLayer::sequence_flops_per_token(int64_t T) const {
  return 3.0 * static_cast<double>(T) * static_cast<double>(c_.n_head) *
         static_cast<double>(c_.qk_nope_head_dim + c_.qk_rope_head_dim + c_.v_head_dim);
}

int64_t MlaLayer::cache_bytes(int64_t length) const {
  return length * (c_.kv_lora_rank + c_.qk_rope_head_dim) * dtype_size(dtype_);
}

Tensor MlaLayer::forward(const Tensor& x, MixerCache* mixer_cache) const {
  MlaCache* cache = cache_as<MlaCache>(mixer_cache, "mla");
  MT_CHECK(x.dim() == 3 && x.size(2) == c_.d_model, "mla layer: x is {} but must be [B, T, {}]", x.shape(),
           c_.d_model);
  const int64_t B = x.size(0), T = x.size(1), H = c_.n_head;
  const int64_t dn = c_.qk_nope_head_dim, dr = c_.qk_rope_head_dim, dv = c_.v_head_dim, rkv = c_.kv_lora_rank;
  const int64_t first = cache ? cache->length() : 0;
  Tensor q = c_.q_lora_rank > 0 ? linear(rms_norm(linear(x, q_a_proj), q_a_layernorm, c_.lora_norm_eps), q_b_proj)
                                : linear(x, q_proj);
  q = reshape(q, {B, T, H, dn + dr});
  Tensors ckr = split(linear(x, kv_a_proj), {rkv, dr}, -1);
  Tensor c = rms_norm(ckr[0], kv_a_layernorm, c_.lora_norm_eps);
  Tensor kr = ckr[1];  // [B, T, dr]
  if (c_.rope && dr > 0) {
    Tensors qs = split(q, {dn, dr}, -1);
    q = concat({qs[0], rope(qs[1], first, c_.rope_theta)}, -1);
    kr = reshape(rope(reshape(kr, {B, T, 1, dr}), first, c_.rope_theta), {B, T, dr});
  }
  if (cache) {
    if (cache->c.defined()) {
      c = concat({cache->c, c}, 1);
      kr = concat({cache->kr, kr}, 1);
    }
    cache->c = c.detach();
    cache->kr = kr.detach();
  }
  const int64_t Tk = c.size(1);
  Tensors kv = split(reshape(linear(c, kv_b_proj), {B, Tk, H, dn + dv}), {dn, dv}, -1);
  Tensor k = concat({kv[0], broadcast_to(reshape(kr, {B, Tk, 1, dr}), Shape{B, Tk, H, dr})}, -1);
  Tensor max_logit;  // [H], from the kernel's log-sum-exp pass, when QK-Clip records
  const bool record = wants_max_logit(site_);
  Tensor o =
      causal_attention(q, k, kv[1], 1.0 / std::sqrt(static_cast<double>(dn + dr)), record ? &max_logit : nullptr);
  if (record) fold_max_logit(*site_, max_logit);
  o = reshape(o, {B, T, H * dv});
  if (c_.output_gate) o = sigmoid_gate(o, linear(x, g_proj));  // o ⊙ σ(x W_g^T), one kernel
  return linear(o, o_proj);
}

}  // namespace moetrain
