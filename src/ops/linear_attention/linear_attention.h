// Causal linear attention with an additive state (Katharopoulos et al. 2020,
// "Transformers are RNNs"), the unnormalised core: per batch element and head,
// with state S [K, V],
//   S_t = S_{t-1} + k_t v_t^T;   o_t = S_t^T q_t          (o_t reads the state that includes token t)
// q and k are used as given: the layer applies the feature map φ (elu + 1) and gets
// the normaliser φ(q_t)^T z_t, z_t = Σ_{s<=t} φ(k_s), from the same op by appending a
// column of ones to v (docs/evolution.md). No decay, no delta rule: the rung of the
// ladder below DeltaNet (ops/kda/kda.h holds the delta-rule family).
//
// Shapes: q, k [B, T, H, K]; v [B, T, H, V]; h0 and the final state [B, H, K, V];
// o [B, T, H, V]. All inputs share one dtype: f32 or f64, or bf16 on CUDA. On CUDA both
// forms run one recurrent kernel with state checkpoints (kda_cuda.cu).
//
// Chunked form (chunks of C tokens, entry state S_n, chunk matrices Q, K [C, K], V [C, V]):
//   O = Q S_n + Tril(Q K^T) V;   S_{n+1} = S_n + K^T V
// Backward, with G = dS_{n+1} (starting from the final state's gradient), chunks in reverse:
//   dA = Tril(dO V^T);  dQ = dO S_n^T + dA K;  dK = dA^T Q + V G^T;  dV = Tril(Q K^T)^T dO + K G;
//   dS_n = G + Q^T dO.
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace moetrain {

struct LinearAttentionResult {
  Tensor o;            // [B, T, H, V]
  Tensor final_state;  // [B, H, K, V]; differentiable
};

// Token by token. h0 may be undefined (zero state). The backward runs one forward
// sweep (dq needs S_t) and one reverse sweep (dk, dv, dS_0); nothing is saved but the inputs.
LinearAttentionResult linear_attention_recurrent(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& h0);

// Chunks of chunk_size tokens (the last may be shorter); saves the chunk-entry states
// for the backward. Same result as linear_attention_recurrent up to rounding.
LinearAttentionResult linear_attention_chunked(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& h0,
                                               int64_t chunk_size = 64);

// Either form.
LinearAttentionResult linear_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& h0,
                                       bool chunked, int64_t chunk_size = 64);

// One decoding step (T = 1): q, k [B, 1, H, K], v [B, 1, H, V]; updates `state`
// [B, H, K, V] in place and returns o [B, 1, H, V]. No autograd. Runs the step
// code of linear_attention_recurrent, so token-by-token decoding equals it bitwise.
Tensor linear_attention_decode_step(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& state);

}  // namespace moetrain
