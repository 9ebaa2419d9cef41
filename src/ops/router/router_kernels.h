// The kernels of the router's expert selection (ops/router/router.h): the CPU's in
// router_cpu.cpp, the GPU's in router_cuda.cu (its body in ops/router/router_simt.h).
#pragma once

#include "backend/cuda/runtime.h"
#include "core/tensor.h"

namespace moetrain::cpu {

// experts [N, k] i64 (on the scores' device) = the top-k of scores [N, E] + bias [E]
// per row, group-limited when n_group > 1, as select_experts picks them.
void select_experts(Tensor& experts, const Tensor& scores, const Tensor& bias, int64_t k, int64_t n_group,
                    int64_t topk_group);

}  // namespace moetrain::cpu

namespace moetrain::cuda {

MT_CUDA_KERNEL(void select_experts(Tensor& experts, const Tensor& scores, const Tensor& bias, int64_t k,
                                   int64_t n_group, int64_t topk_group));

}  // namespace moetrain::cuda
