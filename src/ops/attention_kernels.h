#pragma once

#include "backend/cuda/runtime.h"
#include "core/tensor.h"

namespace moetrain::cpu {

inline constexpr int64_t kAttentionTile = 64;  // query rows per tile

// o [B,T,H,Dv]; lse [B,H,T] = log Σ_{s≤t} exp(scale q_t·k_s).
void causal_attention_forward(Tensor& o, Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                              double scale);
// Per head (P = softmax, S = scaled scores): dV = P^T dO, dP = dO V^T,
// dS = P ⊙ (dP - rowsum(dO ⊙ O)), dQ = scale dS K, dK = scale dS^T Q. Overwrites the grads.
void causal_attention_backward(Tensor& grad_q, Tensor& grad_k, Tensor& grad_v, const Tensor& grad_o,
                               const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
                               const Tensor& lse, double scale);

}  // namespace moetrain::cpu

namespace moetrain::cuda {

// As the CPU kernels (attention_cuda.cu: FlashAttention-style tiles with an
// online softmax). lse is f32 for bf16 q (else q's dtype); head dims up to 256.
MT_CUDA_KERNEL(void causal_attention_forward(Tensor& o, Tensor& lse, const Tensor& q, const Tensor& k,
                                             const Tensor& v, double scale));
MT_CUDA_KERNEL(void causal_attention_backward(Tensor& grad_q, Tensor& grad_k, Tensor& grad_v, const Tensor& grad_o,
                                              const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
                                              const Tensor& lse, double scale));

}  // namespace moetrain::cuda
