// KDA layer forward (docs/model.md#kda-layer). Built from gradient-checked ops; the
// recurrence itself is the KDA op (src/ops/kda/kda.h).
#include "nn/kda_layer.h"

#include <cmath>

#include "core/grad_mode.h"
#include "ops/conv/conv.h"
#include "ops/conv/conv_silu.h"
#include "ops/kda/decay_gate.h"
#include "ops/elementwise/elementwise.h"
#include "ops/kda/kda.h"
#include "ops/linalg/linalg.h"
#include "ops/norm/norm.h"
#include "ops/view/view.h"

namespace moetrain {

namespace {

// log U(1, 16) (A_log, docs/model.md#initialisation).
Tensor log_uniform_1_16(const Shape& s, DType dt, Generator& gen) {
  return log(rand(s, dt, gen, 1.0, 16.0));
}

// dt ~ log U(1e-3, 1e-1) from u ~ U(0, 1): the initial decay rates of both gates' inits.
double log_uniform_dt(double u) { return std::exp(u * (std::log(0.1) - std::log(1e-3)) + std::log(1e-3)); }

// dt_bias for the softplus gate (fla): inverse softplus of dt ~ logU(1e-3, 1e-1), dt >= 1e-4.
Tensor inverse_softplus_dt(const Shape& s, DType dt, Generator& gen) {
  Tensor u = rand(s, DType::f64, gen);
  std::vector<double> v = u.to_vector();
  Tensor out = empty(s, DType::f64);
  double* p = out.data<double>();
  for (size_t i = 0; i < v.size(); ++i) {
    const double d = std::max(log_uniform_dt(v[i]), 1e-4);
    p[i] = d + std::log(-std::expm1(-d));  // softplus^{-1}(d)
  }
  return out.to(dt);
}

// dt_bias for the lower-bound gate, KdaDtBiasInit::spread: at f = 0 the gate
// g = lb·σ(e^{A_log[h]}·dt_bias[h, d]) equals −dt, dt ~ log U(1e-3, 1e-1); dt/|lb| is
// capped at 1/2 so that a small |lb| still gives a finite logit.
Init lower_bound_spread_dt(const Tensor& A_log, double lower_bound) {
  return Init::custom([A_log, lower_bound](const Shape& s, DType dt, Generator& gen) {
    const int64_t HV = A_log.numel(), K = s.numel() / HV;
    const std::vector<double> a = A_log.to(DType::f64).to_vector();
    const std::vector<double> u = rand(s, DType::f64, gen).to_vector();
    Tensor out = empty(s, DType::f64);
    double* p = out.data<double>();
    for (int64_t h = 0; h < HV; ++h)
      for (int64_t d = 0; d < K; ++d) {
        const double r = std::min(log_uniform_dt(u[h * K + d]) / -lower_bound, 0.5);  // σ(e^{A}·dt_bias) = r
        p[h * K + d] = std::log(r / (1 - r)) / std::exp(a[h]);
      }
    return out.to(dt);
  });
}

// SiLU of the depthwise causal conv of x in the compute dtype cd (one fused op, the
// cast to cd included when it is bf16 -> f32: ops/conv/conv_silu.h), continuing from
// `state` (the last W−1 inputs, [B, W−1, P], in cd) when given; updates the state.
Tensor short_conv(const Tensor& x_in, const Tensor& w, DType cd, Tensor* state) {
  // The cast to the compute dtype is fused into the conv when it is bf16 -> f32 (w is f32).
  const bool fused_cast = x_in.dtype() == DType::bf16 && w.dtype() == DType::f32 && cd == DType::f32;
  if (!state && fused_cast) return causal_conv1d_silu(x_in, w);
  const Tensor x = x_in.to(cd);
  if (!state) return causal_conv1d_silu(x, w);
  const int64_t B = x.size(0), T = x.size(1), P = x.size(2), Wm1 = w.size(1) - 1;
  if (Wm1 == 0) return causal_conv1d_silu(x, w);
  if (!state->defined()) *state = zeros({B, Wm1, P}, x.dtype(), x.device());
  Tensor full_in = concat({*state, x}, 1);
  Tensor y = slice(causal_conv1d_silu(full_in, w), 1, Wm1, Wm1 + T);
  *state = slice(full_in, 1, T, T + Wm1).detach().contiguous();
  return y;
}

}  // namespace

int64_t KdaCache::bytes() const {
  int64_t n = 0;
  for (const Tensor* t : {&conv_q, &conv_k, &conv_v, &state})
    if (t->defined()) n += t->nbytes();
  return n;
}

KdaLayer::KdaLayer(const KdaLayerConfig& c, ParamFactory& f, const std::string& p) : c_(c), dtype_(f.dtype()) {
  MT_CHECK(c.n_head >= 1 && c.head_dim >= 1 && c.value_heads() % c.n_head == 0,
           "kda layer {}: n_value_head = {} must be a multiple of n_head = {}", p, c.value_heads(), c.n_head);
  const int64_t D = c.d_model, H = c.n_head, HV = c.value_heads(), K = c.head_dim;
  const int64_t PK = H * K, PV = HV * K;
  const Init w = Init::trunc_normal(c.init_std);
  q_proj = f.make(p + "q_proj.weight", {PK, D}, w, "kda", true);
  k_proj = f.make(p + "k_proj.weight", {PK, D}, w, "kda", true);
  v_proj = f.make(p + "v_proj.weight", {PV, D}, w, "kda", true);
  q_conv = f.make(p + "q_conv1d.weight", {PK, c.conv_size}, w, "kda", false);
  k_conv = f.make(p + "k_conv1d.weight", {PK, c.conv_size}, w, "kda", false);
  v_conv = f.make(p + "v_conv1d.weight", {PV, c.conv_size}, w, "kda", false);
  // Creation order (and so every random init) of KDA's parameters is as before the
  // other decays existed: f_a, f_b, b, A_log, dt_bias.
  if (c.decay == DeltaDecay::per_channel) {
    f_a_proj = f.make(p + "f_a_proj.weight", {K, D}, w, "kda", true);
    f_b_proj = f.make(p + "f_b_proj.weight", {HV * K, K}, w, "kda", true);
  }
  b_proj = f.make(p + "b_proj.weight", {HV, D}, w, "kda", true);
  if (c.decay == DeltaDecay::per_channel) {
    A_log = f.make(p + "A_log", {HV}, Init::custom(log_uniform_1_16), "kda", false);
    Init dt_init = Init::zeros();  // lower bound, KdaDtBiasInit::zero
    if (c.gate == KdaGate::softplus)
      dt_init = Init::custom(inverse_softplus_dt);
    else if (c.dt_bias_init == KdaDtBiasInit::spread && f.allocating())
      dt_init = lower_bound_spread_dt(A_log, c.lower_bound);
    dt_bias = f.make(p + "dt_bias", {HV * K}, dt_init, "kda", false);
  } else if (c.decay == DeltaDecay::per_head) {
    // fla's GatedDeltaNet init: A ~ U(1, 16) (log-uniform here, as KDA's A_log),
    // dt_bias = softplus^{-1}(dt), dt ~ log U(1e-3, 1e-1).
    a_proj = f.make(p + "a_proj.weight", {HV, D}, w, "kda", true);
    A_log = f.make(p + "A_log", {HV}, Init::custom(log_uniform_1_16), "kda", false);
    dt_bias = f.make(p + "dt_bias", {HV}, Init::custom(inverse_softplus_dt), "kda", false);
  }
  if (c.full_rank_output_gate) {
    g_proj = f.make(p + "g_proj.weight", {PV, D}, w, "kda", true);
  } else {
    g_a_proj = f.make(p + "g_a_proj.weight", {K, D}, w, "kda", true);
    g_b_proj = f.make(p + "g_b_proj.weight", {PV, K}, w, "kda", true);
  }
  o_norm = f.make(p + "o_norm.weight", {K}, Init::ones(), "norm", false);
  o_proj = f.make(p + "o_proj.weight", {D, PV}, w, "kda", true);
}

Tensor kda_gate(const Tensor& f, const Tensor& A_log, const Tensor& dt_bias, KdaGate gate, double lower_bound) {
  return decay_gate(f, A_log, dt_bias, gate == KdaGate::softplus ? std::nullopt : std::optional<double>(lower_bound));
}

Tensor gated_deltanet_gate(const Tensor& a, const Tensor& A_log, const Tensor& dt_bias) {
  // The per-head gate is the decay gate with K = 1.
  Shape s = a.shape();
  return reshape(decay_gate(reshape(a, s.appended(1)), A_log, dt_bias, std::nullopt), s);
}

MixerKind KdaLayer::kind() const {
  switch (c_.decay) {
    case DeltaDecay::per_channel: return MixerKind::kda;
    case DeltaDecay::per_head: return MixerKind::gated_deltanet;
    case DeltaDecay::none: return MixerKind::deltanet;
  }
  return MixerKind::kda;
}

double KdaLayer::sequence_flops_per_token(int64_t) const {
  return 24.0 * static_cast<double>(c_.head_dim * c_.head_dim * c_.value_heads());
}

int64_t KdaLayer::cache_bytes(int64_t) const {
  const int64_t H = c_.n_head, HV = c_.value_heads(), K = c_.head_dim;
  return ((c_.conv_size - 1) * (2 * H * K + HV * K) + HV * K * K) * dtype_size(dtype_);  // conv inputs + state
}

Tensor KdaLayer::forward(const Tensor& x, MixerCache* mixer_cache) const {
  KdaCache* cache = cache_as<KdaCache>(mixer_cache, "kda");
  MT_CHECK(x.dim() == 3 && x.size(2) == c_.d_model, "kda layer: x is {} but must be [B, T, {}]", x.shape(),
           c_.d_model);
  const int64_t B = x.size(0), T = x.size(1), H = c_.n_head, HV = c_.value_heads(), K = c_.head_dim;
  // Mixed precision (bf16 x): the projections run in bf16; from their outputs to
  // o_proj's input the layer computes in f32 (short conv, gates, the recurrence and
  // its state, the output norm), whose parameters stay f32 (docs/model.md#mixed-precision).
  const DType cd = x.dtype() == DType::bf16 ? DType::f32 : x.dtype();
  Tensor q = short_conv(linear(x, q_proj), q_conv, cd, cache ? &cache->conv_q : nullptr);
  Tensor k = short_conv(linear(x, k_proj), k_conv, cd, cache ? &cache->conv_k : nullptr);
  Tensor v = short_conv(linear(x, v_proj), v_conv, cd, cache ? &cache->conv_v : nullptr);
  q = l2_norm(reshape(q, {B, T, H, K}), c_.l2norm_eps);
  k = l2_norm(reshape(k, {B, T, H, K}), c_.l2norm_eps);
  v = reshape(v, {B, T, HV, K});
  Tensor g;  // KDA: [B, T, HV, K]; Gated DeltaNet: [B, T, HV]; DeltaNet: none
  if (c_.decay == DeltaDecay::per_channel)
    g = kda_gate(reshape(linear(linear(x, f_a_proj), f_b_proj).to(cd), {B, T, HV, K}), A_log, dt_bias, c_.gate,
                 c_.lower_bound);
  else if (c_.decay == DeltaDecay::per_head)
    g = gated_deltanet_gate(linear(x, a_proj).to(cd), A_log, dt_bias);
  Tensor beta = sigmoid(linear(x, b_proj).to(cd));  // [B, T, HV]
  const double scale = 1.0 / std::sqrt(static_cast<double>(K));
  Tensor o;
  if (cache && T == 1 && !autograd::grad_enabled()) {
    // Decoding one token: the constant-size state is updated in place.
    if (!cache->state.defined()) cache->state = zeros({B, HV, K, K}, cd, x.device());
    switch (c_.decay) {
      case DeltaDecay::per_channel: o = kda_decode_step(q, k, v, g, beta, cache->state, scale); break;
      case DeltaDecay::per_head: o = gated_delta_rule_decode_step(q, k, v, g, beta, cache->state, scale); break;
      case DeltaDecay::none: o = delta_rule_decode_step(q, k, v, beta, cache->state, scale); break;
    }
  } else {
    Tensor h0 = cache ? cache->state : Tensor();
    const KdaMode mode = c_.chunked ? KdaMode::chunked : KdaMode::recurrent;
    KdaResult r;
    switch (c_.decay) {
      case DeltaDecay::per_channel: r = kda(q, k, v, g, beta, h0, scale, mode, c_.chunk_size); break;
      case DeltaDecay::per_head: r = gated_delta_rule(q, k, v, g, beta, h0, scale, mode, c_.chunk_size); break;
      case DeltaDecay::none: r = delta_rule(q, k, v, beta, h0, scale, mode, c_.chunk_size); break;
    }
    if (cache) cache->state = r.final_state.detach().clone();  // owned: decode steps update it in place
    o = r.o;
  }
  Tensor z = c_.full_rank_output_gate ? linear(x, g_proj) : linear(linear(x, g_a_proj), g_b_proj);
  // A bf16 gate under f32 o: gated_rms_norm reads it as it is (its cast fused, ops/norm/norm.cpp).
  if (!(z.dtype() == DType::bf16 && cd == DType::f32)) z = z.to(cd);
  o = gated_rms_norm(o, o_norm, reshape(z, {B, T, HV, K}), c_.norm_eps);  // RMSNorm(o) ⊙ σ(z), fused
  return linear(reshape(o, {B, T, HV * K}).to(x.dtype()), o_proj);
}

}  // namespace moetrain
