// KDA token mixer (docs/model.md#kda-layer), Hugging Face / fla parameter names:
//   q,k,v = silu(short_conv(x W{q,k,v}^T))            W [P, D]; conv [P, W] depthwise causal
//   g     = gate(x Wfa^T Wfb^T)                        softplus: −e^{A_log}·softplus(f + dt_bias)
//                                                      lower bound: lb·σ(e^{A_log}(f + dt_bias))
//   β     = σ(x Wb^T)
//   o, S  = KDA(l2norm(q), l2norm(k), v, g, β; K^{-1/2}, S_0)      docs/model.md#kda-recurrent-form
//   y     = (RMSNorm_V(o; w_o) ⊙ σ(z)) Wo^T,  z = x Wg^T (full rank) or x Wga^T Wgb^T
// The same layer builds the two rungs below KDA on the evolution ladder
// (docs/evolution.md), which differ from it in the decay only (`decay`):
//   DeltaNet:       no decay (g = 0; no f/A_log/dt_bias parameters)        ops delta_rule
//   Gated DeltaNet: one decay per value head and step, Mamba-2's gate       ops gated_delta_rule
//                   g = −e^{A_log}·softplus(x Wa^T + dt_bias), Wa [HV, D] (a_proj), A_log, dt_bias [HV]
// Everything else (projections, short convs, L2 norm, β, output gate and norm) is shared.
// With grouped value heads (HV = n_value_head > H) v, g, β, the output gate and
// the output norm belong to the value heads; q/k head h serves value heads
// hG..hG+G−1. Kimi uses HV = H, K = V = head_dim.
#pragma once

#include <string>

#include "core/tensor.h"
#include "nn/mixer.h"
#include "nn/param_factory.h"

namespace moetrain {

enum class KdaGate { softplus, lower_bound };

// Initial decays of the lower-bound gate (docs/model.md#initialisation, docs/model.md#initial-decays-of-the-lower-bound-gate); the softplus
// gate always uses fla's init (dt ~ log U(1e-3, 1e-1) through softplus^{-1}).
//   spread: dt_bias[h, d] = logit(dt / |lb|) / e^{A_log[h]}, dt ~ log U(1e-3, 1e-1),
//           so that g = −dt at f = 0: every channel starts with a long memory, spread
//           over two decades (the spec's proposed alternative);
//   zero:   dt_bias = 0 (the TT-K3 port): g = lb·σ(0) = lb/2 = −2.5 everywhere at
//           f = 0, about one token of memory.
enum class KdaDtBiasInit { spread, zero };

// Which decay the delta-rule layer has: per key channel (KDA), per head (Gated DeltaNet), none (DeltaNet).
enum class DeltaDecay { per_channel, per_head, none };

struct KdaLayerConfig {
  DeltaDecay decay = DeltaDecay::per_channel;
  int64_t d_model = 256;
  int64_t n_head = 4;        // H: query/key heads
  int64_t n_value_head = 0;  // HV; 0 = n_head
  int64_t head_dim = 64;     // K = V
  int64_t conv_size = 4;
  KdaGate gate = KdaGate::lower_bound;
  double lower_bound = -5.0;
  KdaDtBiasInit dt_bias_init = KdaDtBiasInit::spread;  // lower-bound gate only
  bool full_rank_output_gate = true;
  double norm_eps = 1e-5;    // output RMSNorm
  double l2norm_eps = 1e-6;  // q/k L2 norm
  bool chunked = true;       // chunked (WY/UT) kernels; false: the step-by-step reference
  int64_t chunk_size = 64;
  double init_std = 0.02;

  int64_t value_heads() const { return n_value_head > 0 ? n_value_head : n_head; }
};

// Decoding state of one layer: the last W−1 projected inputs of each short conv
// and the recurrent state. Constant size in the sequence length.
struct KdaCache : MixerCache {
  Tensor conv_q, conv_k, conv_v;  // [B, W−1, P] (undefined before the first call)
  Tensor state;                   // [B, HV, K, V]
  int64_t bytes() const override;
};

class KdaLayer : public Mixer {
 public:
  // prefix: e.g. "model.layers.0.self_attn."
  KdaLayer(const KdaLayerConfig& c, ParamFactory& factory, const std::string& prefix);

  // kda, deltanet or gated_deltanet, by the decay.
  MixerKind kind() const override;
  // x [B, T, D] (the normed sublayer input) -> [B, T, D]. With a KdaCache: continues
  // from its state and updates it (no autograd needed, but recorded if enabled).
  Tensor forward(const Tensor& x, MixerCache* cache = nullptr) const override;
  std::unique_ptr<MixerCache> new_cache() const override { return std::make_unique<KdaCache>(); }
  // The state read, decay, delta update and output per token: ~ 24·K·V·HV (forward + backward).
  double sequence_flops_per_token(int64_t seq_len) const override;
  // The short convolutions' last W−1 inputs and the state: constant in the length.
  int64_t cache_bytes(int64_t length) const override;

  const KdaLayerConfig& config() const { return c_; }

  Tensor q_proj, k_proj, v_proj, q_conv, k_conv, v_conv, f_a_proj, f_b_proj, b_proj, A_log, dt_bias;
  Tensor a_proj;  // Gated DeltaNet's decay projection [HV, D]
  Tensor g_proj, g_a_proj, g_b_proj, o_norm, o_proj;

 private:
  KdaLayerConfig c_;
  DType dtype_;
};

// Gated DeltaNet's (Mamba-2's) decay gate on a [..., HV] with A_log, dt_bias [HV]:
// g = −e^{A_log}·softplus(a + dt_bias), [..., HV].
Tensor gated_deltanet_gate(const Tensor& a, const Tensor& A_log, const Tensor& dt_bias);

// The decay gate of docs/model.md#decay-gate on f [..., HV, K] with A_log [HV], dt_bias [HV·K]: g [..., HV, K].
Tensor kda_gate(const Tensor& f, const Tensor& A_log, const Tensor& dt_bias, KdaGate gate, double lower_bound);

}  // namespace moetrain
