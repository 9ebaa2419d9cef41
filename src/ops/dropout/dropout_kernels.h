#pragma once

#include <cstdint>

#include "backend/cuda/runtime.h"
#include "core/rng.h"
#include "core/tensor.h"

namespace moetrain {

namespace cpu {

// out[i] = in[i] * keep(i) / (1 - p), keep(i) = uniform(first + i) >= p.
// Forward and backward are the same map (in = x or grad_y).
void dropout_apply(Tensor& out, const Tensor& in, double p, const Generator& gen, uint64_t first);

}  // namespace cpu

// The CUDA twin (dropout_cuda.cu): the same Philox stream, so the same mask.
namespace cuda {
MT_CUDA_KERNEL(void dropout_apply(Tensor& out, const Tensor& in, double p, const Generator& gen, uint64_t first));
}  // namespace cuda

}  // namespace moetrain
