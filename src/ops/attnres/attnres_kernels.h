#pragma once

#include <vector>

#include "backend/cuda/runtime.h"
#include "core/tensor.h"

namespace moetrain {

namespace cpu {

// h [N, D] (as the sources' shape); alpha, rstd: [N, M] (saved for backward).
void attn_res_forward(Tensor& h, Tensor& alpha, Tensor& rstd, const std::vector<const Tensor*>& sources,
                      const Tensor& proj, const Tensor& norm, double eps);
// grad_sources[m] (undefined: not needed), grad_proj, grad_norm (null: not needed); all overwritten.
void attn_res_backward(std::vector<Tensor>& grad_sources, Tensor* grad_proj, Tensor* grad_norm,
                       const Tensor& grad_h, const std::vector<const Tensor*>& sources, const Tensor& proj,
                       const Tensor& norm, const Tensor& alpha, const Tensor& rstd);

}  // namespace cpu

// The CUDA twins (attnres_cuda.cu): same contracts, up to 64 sources; alpha and
// rstd are f32 for bf16 sources.
namespace cuda {
MT_CUDA_KERNEL(void attn_res_forward(Tensor& h, Tensor& alpha, Tensor& rstd, const std::vector<const Tensor*>& sources,
                                     const Tensor& proj, const Tensor& norm, double eps));
MT_CUDA_KERNEL(void attn_res_backward(std::vector<Tensor>& grad_sources, Tensor* grad_proj, Tensor* grad_norm,
                                      const Tensor& grad_h, const std::vector<const Tensor*>& sources,
                                      const Tensor& proj, const Tensor& norm, const Tensor& alpha,
                                      const Tensor& rstd));
}  // namespace cuda

}  // namespace moetrain
