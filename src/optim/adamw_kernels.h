// The CUDA twins of AdamW's loops (adamw_cuda.cu): the fused update (decay,
// both moments and the step in one pass over each parameter), its read-only
// check (non_finite_update) and the pieces of gradient clipping. The CPU
// versions are the loops in adamw.cpp. adamw_element below is the arithmetic of
// one element, written once for both backends and both passes: the check
// computes the very expressions the update stores.
#pragma once

#include <cmath>

#include "backend/cuda/runtime.h"
#include "core/tensor.h"
#include "ops/common/simt.h"  // MT_HOST_DEVICE

namespace moetrain {

struct AdamWCoefficients {
  double decay, b1, b2, step_size, bc2_sqrt, eps;
};

// The coefficients in the arithmetic type T (the parameter's dtype; f32 for a
// bf16 parameter's master), converted once per loop.
template <class T> struct AdamWScalars {
  T decay, b1, b2, step_size, bc2_sqrt, eps;
  MT_HOST_DEVICE explicit AdamWScalars(const AdamWCoefficients& k)
      : decay(static_cast<T>(k.decay)), b1(static_cast<T>(k.b1)), b2(static_cast<T>(k.b2)),
        step_size(static_cast<T>(k.step_size)), bc2_sqrt(static_cast<T>(k.bc2_sqrt)), eps(static_cast<T>(k.eps)) {}
};

#if defined(__CUDACC__)
#define MT_ADAMW_INLINE __forceinline__
#else
#define MT_ADAMW_INLINE inline __attribute__((always_inline))
#endif

template <class T> struct AdamWElement {
  T w, m, v;  // the new parameter (or master), first and second moment
};

// One element: decoupled decay, both moments, the step, in PyTorch's order
// (adamw.h). Inlined into every loop that calls it, so each compiles it alike
// (on the CPU: the same target clone, the same multiply-add contraction).
template <class T>
MT_HOST_DEVICE MT_ADAMW_INLINE AdamWElement<T> adamw_element(T w, T g, T m, T v, const AdamWScalars<T>& k) {
  const T mj = m * k.b1 + g * (T(1) - k.b1);
  const T vj = v * k.b2 + g * g * (T(1) - k.b2);
#if defined(__CUDA_ARCH__)
  const T root = sqrt(vj);
#else
  const T root = std::sqrt(vj);
#endif
  return {w * k.decay - k.step_size * mj / (root / k.bc2_sqrt + k.eps), mj, vj};
}

namespace cuda {
// w, g, m, v of one parameter (same dtype: f32 or f64).
MT_CUDA_KERNEL(void adamw_update(Tensor& w, const Tensor& g, Tensor& m, Tensor& v, const AdamWCoefficients& k));
// Mixed precision: w and g bf16; master, m, v f32. The f32 update of the master
// (as adamw_update's f32 kernel, from g widened to f32), then w = bf16(master),
// rounded to nearest even.
MT_CUDA_KERNEL(void adamw_update_bf16_master(Tensor& w, const Tensor& g, Tensor& master, Tensor& m, Tensor& v,
                                             const AdamWCoefficients& k));
// The checks of non_finite_update, writing nothing but counts: counts[index] +=
// the elements whose update (as adamw_update would compute it) leaves the new
// w, m or v NaN or infinite. counts: i64 on the parameter's device, so a step's
// checks end in one device-to-host read.
MT_CUDA_KERNEL(void adamw_count_non_finite(Tensor& counts, int64_t index, const Tensor& w, const Tensor& g,
                                           const Tensor& m, const Tensor& v, const AdamWCoefficients& k));
// Mixed precision (as adamw_update_bf16_master): also counts a finite master
// whose bf16 rounding is infinite.
MT_CUDA_KERNEL(void adamw_count_non_finite_bf16_master(Tensor& counts, int64_t index, const Tensor& g,
                                                       const Tensor& master, const Tensor& m, const Tensor& v,
                                                       const AdamWCoefficients& k));
// acc[0] += sum of g^2 (acc: an f64 tensor of one element on g's device),
// accumulated in double in a fixed order (same bits every run).
MT_CUDA_KERNEL(void add_squared_sum(Tensor& acc, const Tensor& g));
// g *= coef.
MT_CUDA_KERNEL(void scale(Tensor& g, double coef));
}  // namespace cuda

}  // namespace moetrain
