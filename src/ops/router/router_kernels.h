// The router's expert selection on the GPU (router_cuda.cu, the body in
// ops/router/router_simt.h); its CPU twin is select_experts in nn/moe.cpp.
#pragma once

#include "backend/cuda/runtime.h"
#include "core/tensor.h"

namespace moetrain::cuda {

// experts [N, k] i64 (on the scores' device) = the top-k of scores [N, E] + bias [E]
// per row, group-limited when n_group > 1, as select_experts picks them.
MT_CUDA_KERNEL(void select_experts(Tensor& experts, const Tensor& scores, const Tensor& bias, int64_t k,
                                   int64_t n_group, int64_t topk_group));

}  // namespace moetrain::cuda
