// The CUDA twins of AdamW's loops (adamw_cuda.cu): the fused update (decay,
// both moments and the step in one pass over each parameter) and the pieces of
// gradient clipping. The CPU versions are the loops in adamw.cpp.
#pragma once

#include "backend/cuda/runtime.h"
#include "core/tensor.h"

namespace moetrain {

struct AdamWCoefficients {
  double decay, b1, b2, step_size, bc2_sqrt, eps;
};

namespace cuda {
// w, g, m, v of one parameter (same dtype: f32 or f64).
MT_CUDA_KERNEL(void adamw_update(Tensor& w, const Tensor& g, Tensor& m, Tensor& v, const AdamWCoefficients& k));
// Mixed precision: w and g bf16; master, m, v f32. The f32 update of the master
// (as adamw_update's f32 kernel, from g widened to f32), then w = bf16(master),
// rounded to nearest even.
MT_CUDA_KERNEL(void adamw_update_bf16_master(Tensor& w, const Tensor& g, Tensor& master, Tensor& m, Tensor& v,
                                             const AdamWCoefficients& k));
// acc[0] += sum of g^2 (acc: an f64 tensor of one element on g's device),
// accumulated in double in a fixed order (same bits every run).
MT_CUDA_KERNEL(void add_squared_sum(Tensor& acc, const Tensor& g));
// g *= coef.
MT_CUDA_KERNEL(void scale(Tensor& g, double coef));
}  // namespace cuda

}  // namespace moetrain
