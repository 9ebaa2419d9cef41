// Linear-attention CPU kernels (ops/linear_attention/linear_attention.h). Forward kernels take
// `state` holding S_0 and leave S_T in it. Backward kernels overwrite every grad_*
// tensor; grad_h0 [B, H, K, V] always receives dS_0.
#pragma once

#include <cstdint>

#include "backend/cuda/runtime.h"
#include "core/tensor.h"

namespace moetrain::cpu {

inline int64_t linear_attention_num_chunks(int64_t T, int64_t chunk_size) { return (T + chunk_size - 1) / chunk_size; }

void linear_attention_recurrent_forward(Tensor& o, Tensor& state, const Tensor& q, const Tensor& k, const Tensor& v);
// h0: the initial state, or undefined (zero).
void linear_attention_recurrent_backward(Tensor& grad_q, Tensor& grad_k, Tensor& grad_v, Tensor& grad_h0,
                                         const Tensor& grad_o, const Tensor& grad_final_state, const Tensor& q,
                                         const Tensor& k, const Tensor& v, const Tensor& h0);

// chunk_states: null, or [B, H, num_chunks(T, chunk_size), K, V], receiving every chunk-entry state S_n.
void linear_attention_chunked_forward(Tensor& o, Tensor& state, Tensor* chunk_states, const Tensor& q,
                                      const Tensor& k, const Tensor& v, int64_t chunk_size);
void linear_attention_chunked_backward(Tensor& grad_q, Tensor& grad_k, Tensor& grad_v, Tensor& grad_h0,
                                       const Tensor& grad_o, const Tensor& grad_final_state, const Tensor& q,
                                       const Tensor& k, const Tensor& v, const Tensor& chunk_states,
                                       int64_t chunk_size);

}  // namespace moetrain::cpu

// The CUDA kernels (kda_cuda.cu, the recurrent KDA kernels without the delta rule)
// serve both forms: the forward saves the state every cpu::kKdaRecurrentSegment steps
// into `checkpoints` ([B, H, segments, K, V], f32 for bf16 inputs), the backward
// recomputes each segment's states from them.
namespace moetrain::cuda {
MT_CUDA_KERNEL(void linear_attention_forward(Tensor& o, Tensor& state, Tensor* checkpoints, const Tensor& q,
                                             const Tensor& k, const Tensor& v));
MT_CUDA_KERNEL(void linear_attention_backward(Tensor& grad_q, Tensor& grad_k, Tensor& grad_v, Tensor& grad_h0,
                                              const Tensor& grad_o, const Tensor& grad_final_state, const Tensor& q,
                                              const Tensor& k, const Tensor& v, const Tensor& checkpoints));
}  // namespace moetrain::cuda
