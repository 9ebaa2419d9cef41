// KDA CPU kernels (docs/model.md#kda-recurrent-form, docs/model.md#kda-chunked-form). Shapes as in ops/kda.h. Forward kernels
// take `state` holding S_0 and leave S_T in it. Backward kernels overwrite every
// grad_* tensor; grad_h0 [B, HV, K, V] always receives dS_0.
#pragma once

#include <cstdint>

#include "backend/cpu/isa.h"
#include "backend/cuda/runtime.h"
#include "core/tensor.h"

namespace moetrain::cpu {

// The recurrent backward recomputes the states of kKdaRecurrentSegment steps at
// a time from checkpoints saved every that many steps by the forward.
constexpr int64_t kKdaRecurrentSegment = 64;

inline int64_t kda_num_segments(int64_t T, int64_t length) { return (T + length - 1) / length; }

// checkpoints: null, or [B, HV, num_segments(T, kKdaRecurrentSegment), K, V], receiving
// the state before each segment.
void kda_recurrent_forward(Tensor& o, Tensor& state, Tensor* checkpoints, const Tensor& q, const Tensor& k,
                           const Tensor& v, const Tensor& g, const Tensor& beta, double scale);
void kda_recurrent_backward(Tensor& grad_q, Tensor& grad_k, Tensor& grad_v, Tensor& grad_g, Tensor& grad_beta,
                            Tensor& grad_h0, const Tensor& grad_o, const Tensor& grad_final_state, const Tensor& q,
                            const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                            const Tensor& checkpoints, double scale);

// chunk_states: null, or [B, HV, num_segments(T, chunk_size), K, V], receiving every
// chunk-entry state S_n (the backward reads them instead of recomputing the scan).
void kda_chunked_forward(Tensor& o, Tensor& state, Tensor* chunk_states, const Tensor& q, const Tensor& k,
                         const Tensor& v, const Tensor& g, const Tensor& beta, double scale, int64_t chunk_size);
void kda_chunked_backward(Tensor& grad_q, Tensor& grad_k, Tensor& grad_v, Tensor& grad_g, Tensor& grad_beta,
                          Tensor& grad_h0, const Tensor& grad_o, const Tensor& grad_final_state, const Tensor& q,
                          const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                          const Tensor& chunk_states, double scale, int64_t chunk_size);

// The chunked kernels run one of three compiled copies: AVX-512 (F/VL/BW/DQ), AVX2 + FMA,
// or the portable one, the widest that cpu::vector_isa() allows (backend/cpu/isa.h:
// CPUID, MOETRAIN_ISA, MOETRAIN_GEMM=portable). The copies round differently (FMA,
// vector exp), each is deterministic for any thread count. For tests: the copy in use,
// and a process-wide cap below vector_isa() (unforce: back to vector_isa()).
VectorIsa kda_chunked_isa();
void kda_chunked_force_isa(VectorIsa cap);
void kda_chunked_unforce_isa();

}  // namespace moetrain::cpu

// The CUDA twins (kda_cuda.cu): same contracts, except that the checkpoints and
// chunk states are f32 for bf16 inputs (the state's arithmetic type), K and V are
// bounded by 48 KiB of shared memory per block (4K + 2V + 1 values) and the chunk
// size by C² + C values in it.
namespace moetrain::cuda {
MT_CUDA_KERNEL(void kda_recurrent_forward(Tensor& o, Tensor& state, Tensor* checkpoints, const Tensor& q,
                                          const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                                          double scale));
MT_CUDA_KERNEL(void kda_recurrent_backward(Tensor& grad_q, Tensor& grad_k, Tensor& grad_v, Tensor& grad_g,
                                           Tensor& grad_beta, Tensor& grad_h0, const Tensor& grad_o,
                                           const Tensor& grad_final_state, const Tensor& q, const Tensor& k,
                                           const Tensor& v, const Tensor& g, const Tensor& beta,
                                           const Tensor& checkpoints, double scale));
MT_CUDA_KERNEL(void kda_chunked_forward(Tensor& o, Tensor& state, Tensor* chunk_states, const Tensor& q,
                                        const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                                        double scale, int64_t chunk_size));
MT_CUDA_KERNEL(void kda_chunked_backward(Tensor& grad_q, Tensor& grad_k, Tensor& grad_v, Tensor& grad_g,
                                         Tensor& grad_beta, Tensor& grad_h0, const Tensor& grad_o,
                                         const Tensor& grad_final_state, const Tensor& q, const Tensor& k,
                                         const Tensor& v, const Tensor& g, const Tensor& beta,
                                         const Tensor& chunk_states, double scale, int64_t chunk_size));
// The chunked form's state products (the scans and the output, ops/kda/kda_tc.h) on
// TF32 tensor cores for f32 and bf16 inputs: off by default (f32 products, as
// the CPU); the trainer turns it on for bf16 runs and train.tf32. Applies where
// K, V and C are multiples of 16 on sm_80 and later; elsewhere the scalar bodies run.
MT_CUDA_KERNEL(void set_kda_tensor_cores(bool enabled));
// Columns of S per chunked scan block, both paths: 0 (the default) for the
// automatic choice from the shape and the device's multiprocessor count
// (ops/kda/kda_tc.h: kda_scan_columns), or 8, 16, 32 or 64 where the path takes it
// (the tensor-core scans 16 or 32 dividing V; the scalar ones any up to V rounded
// up to 8), else the automatic choice. For benchmarks and tests: the results do not
// depend on it.
MT_CUDA_KERNEL(void set_kda_scan_columns(int columns));
// The tile of columns that kda_chunked's scans take on the current device for f32
// or bf16 inputs of `tasks` = B x HV value heads, K, V and chunk C (the path as
// set_kda_tensor_cores and the shape decide; set_kda_scan_columns' override): what
// moetrain_bench_cuda prints beside its rows.
MT_CUDA_KERNEL(int kda_chunked_scan_columns(int64_t tasks, int64_t K, int64_t V, int64_t chunk_size));
}  // namespace moetrain::cuda
