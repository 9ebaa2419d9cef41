#pragma once

#include "backend/cuda/runtime.h"
#include "core/tensor.h"

namespace moetrain::cpu {

inline constexpr int64_t kAttentionTile = 64;  // query rows per tile

// o [B,T,H,Dv]; lse [B,H,T] = log Σ_{s≤t} exp(scale q_t·k_s). row_max null, or
// [B,H,T] as lse: written with max_{s≤t} scale q_t·k_s, the max lse subtracts.
void causal_attention_forward(Tensor& o, Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                              double scale, Tensor* row_max);
// Per head (P = softmax, S = scaled scores): dV = P^T dO, dP = dO V^T,
// dS = P ⊙ (dP - rowsum(dO ⊙ O)), dQ = scale dS K, dK = scale dS^T Q. Overwrites grad_q;
// adds into grad_k and grad_v (the op passes zeros).
void causal_attention_backward(Tensor& grad_q, Tensor& grad_k, Tensor& grad_v, const Tensor& grad_o,
                               const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
                               const Tensor& lse, double scale);

}  // namespace moetrain::cpu

namespace moetrain::cuda {

// As the CPU kernels (attention_cuda.cu: FlashAttention-style tiles with an
// online softmax). lse (and row_max) are f32 for bf16 q (else q's dtype); head dims
// up to 256. row_max: the online softmax's running max m after the last key tile.
MT_CUDA_KERNEL(void causal_attention_forward(Tensor& o, Tensor& lse, const Tensor& q, const Tensor& k,
                                             const Tensor& v, double scale, Tensor* row_max));
MT_CUDA_KERNEL(void causal_attention_backward(Tensor& grad_q, Tensor& grad_k, Tensor& grad_v, const Tensor& grad_o,
                                              const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
                                              const Tensor& lse, double scale));

// bf16 attention with head dims that are multiples of 16 (up to 256) runs on the
// tensor cores (attention_tc_cuda.cu, ops/attention/attention_tc.h) where the GPU has
// them (sm_80+) and enough shared memory; everything else on the scalar kernels.
// set_attention_tensor_cores(false) sends every call to the scalar kernels
// (benchmarks, A/B checks); process-wide.
MT_CUDA_KERNEL(void set_attention_tensor_cores(bool enabled));
// set_attention_register_accumulators(false) sends the head dims whose
// tensor-core kernels keep their accumulators in registers to the shared-memory
// accumulators instead (A/B checks of the two paths on a GPU); process-wide.
MT_CUDA_KERNEL(void set_attention_register_accumulators(bool enabled));
MT_CUDA_KERNEL(bool attention_tensor_cores_apply(const Tensor& q, int64_t Dk, int64_t Dv));
MT_CUDA_KERNEL(void attention_tc_forward(Tensor& o, Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                                         double scale, Tensor* row_max));
// delta [B, H, T] (f32): rowsum(dO ⊙ O), as the scalar backward computes it.
MT_CUDA_KERNEL(void attention_tc_backward(Tensor& grad_q, Tensor& grad_k, Tensor& grad_v, const Tensor& grad_o,
                                          const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& lse,
                                          const Tensor& delta, double scale));

}  // namespace moetrain::cuda
