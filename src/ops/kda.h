// KDA (Kimi Delta Attention) core op, MODEL_SPEC §5 (recurrent form, BPTT
// backward) and §6 (chunked WY/UT form, forward and backward). Per batch element
// and value head, with state S [K, V]:
//   S'_t = Diag(exp(g_t)) S_{t-1};  δ_t = v_t - S'_t^T k_t;  S_t = S'_t + β_t k_t δ_t^T;  o_t = S_t^T (scale q_t)
//
// Shapes (letters as in the spec): q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K]
// (log decay, expected <= 0); beta [B, T, HV]; h0 and the final state [B, HV, K, V];
// o [B, T, HV, V]. HV is a multiple of H (grouped value heads, "GVA"): q/k head h
// serves value heads h·G .. h·G+G-1 with G = HV / H, and dq, dk sum over the group.
// The spec (§4, §5) only says that q/k are repeated over the value heads; decay
// and beta belong to the value heads as in fla's KDA (g [B,T,HV,K], beta [B,T,HV]).
// q and k are used as given (the layer L2-normalises them); scale multiplies q
// (the layer passes K^-1/2). All inputs share one dtype (f32 or f64), CPU only.
#pragma once

#include <cstdint>
#include <string>

#include "core/tensor.h"

namespace moetrain {

struct KdaResult {
  Tensor o;            // [B, T, HV, V]
  Tensor final_state;  // [B, HV, K, V]; differentiable, its gradient feeds the backward
};

enum class KdaMode { recurrent, chunked };

// "recurrent" or "chunked"; anything else throws, naming the choices.
KdaMode parse_kda_mode(const std::string& name);
const char* kda_mode_name(KdaMode mode);

// Token-by-token recurrence (§5) with the hand-written BPTT backward. h0 may be undefined (zero state).
KdaResult kda_recurrent(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                        const Tensor& h0, double scale);

// Chunked WY/UT form (§6) with chunks of chunk_size tokens (the last one may be shorter).
// Same result as kda_recurrent up to rounding.
KdaResult kda_chunked(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                      const Tensor& h0, double scale, int64_t chunk_size = 64);

// Either form; chunk_size is used by the chunked one.
KdaResult kda(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta, const Tensor& h0,
              double scale, KdaMode mode, int64_t chunk_size = 64);

// One decoding step (T = 1): q, k [B, 1, H, K], v [B, 1, HV, V], g [B, 1, HV, K],
// beta [B, 1, HV]. Updates `state` [B, HV, K, V] in place and returns o [B, 1, HV, V].
// No autograd (state must not require grad). Runs the same step code as
// kda_recurrent, so a sequence decoded token by token equals it bitwise.
Tensor kda_decode_step(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                       const Tensor& state, double scale);

}  // namespace moetrain
