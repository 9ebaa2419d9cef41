// KDA (Kimi Delta Attention) core op, docs/model.md#kda-recurrent-form (recurrent form, BPTT
// backward) and docs/model.md#kda-chunked-form (chunked WY/UT form, forward and backward). Per batch element
// and value head, with state S [K, V]:
//   S'_t = Diag(exp(g_t)) S_{t-1};  δ_t = v_t - S'_t^T k_t;  S_t = S'_t + β_t k_t δ_t^T;  o_t = S_t^T (scale q_t)
//
// Shapes (letters as in the spec): q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K]
// (log decay, expected <= 0); beta [B, T, HV]; h0 and the final state [B, HV, K, V];
// o [B, T, HV, V]. HV is a multiple of H (grouped value heads, "GVA"): q/k head h
// serves value heads h·G .. h·G+G-1 with G = HV / H, and dq, dk sum over the group.
// docs/model.md#kda-layer only says that q/k are repeated over the value heads; decay
// and beta belong to the value heads as in fla's KDA (g [B,T,HV,K], beta [B,T,HV]).
// q and k are used as given (the layer L2-normalises them); scale multiplies q
// (the layer passes K^-1/2). All inputs share one dtype: f32 or f64, or bf16 on CUDA
// (the state and the checkpoints are then f32); the CUDA kernels are kda_cuda.cu.
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

// Token-by-token recurrence (docs/model.md#kda-recurrent-form) with the hand-written BPTT backward. h0 may be undefined (zero state).
KdaResult kda_recurrent(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                        const Tensor& h0, double scale);

// Chunked WY/UT form (docs/model.md#kda-chunked-form) with chunks of chunk_size tokens (the last one may be shorter).
// Same result as kda_recurrent up to rounding.
KdaResult kda_chunked(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                      const Tensor& h0, double scale, int64_t chunk_size = 64);

// Either form; chunk_size is used by the chunked one.
KdaResult kda(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta, const Tensor& h0,
              double scale, KdaMode mode, int64_t chunk_size = 64);

// The rungs below KDA on the evolution ladder (docs/evolution.md), as exact special
// cases of the same recurrence and kernels: the log decay g is built here and the
// KDA op does the rest, so the recurrent and chunked forms, their backward and the
// decode step are KDA's.
//   DeltaNet (Schlag et al. 2021; Yang et al. 2024, "Parallelizing Linear Transformers
//   with the Delta Rule"): no decay, g = 0, i.e. S_t = S_{t-1} + β_t k_t (v_t - S_{t-1}^T k_t)^T.
//   Gated DeltaNet (Yang et al. 2024, "Gated Delta Networks"): one log decay per value
//   head and step, g [B, T, HV], broadcast over the K key channels (α_t = e^{g_t} scales
//   the whole state, Mamba-2 style); KDA makes it per channel.
KdaResult delta_rule(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& beta, const Tensor& h0,
                     double scale, KdaMode mode, int64_t chunk_size = 64);
KdaResult gated_delta_rule(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                           const Tensor& h0, double scale, KdaMode mode, int64_t chunk_size = 64);
// Their decode steps (shapes as kda_decode_step's, g [B, 1, HV]).
Tensor delta_rule_decode_step(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& beta,
                              const Tensor& state, double scale);
Tensor gated_delta_rule_decode_step(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                    const Tensor& beta, const Tensor& state, double scale);

// One decoding step (T = 1): q, k [B, 1, H, K], v [B, 1, HV, V], g [B, 1, HV, K],
// beta [B, 1, HV]. Updates `state` [B, HV, K, V] in place and returns o [B, 1, HV, V].
// No autograd (state must not require grad). Runs the same step code as
// kda_recurrent, so a sequence decoded token by token equals it bitwise.
Tensor kda_decode_step(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                       const Tensor& state, double scale);

}  // namespace moetrain
