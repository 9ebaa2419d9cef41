// The CUDA entry points of the MoE grouped GEMM on tensor cores
// (grouped_gemm_tc_cuda.cu; the bodies and the design: grouped_gemm_tc.h). The
// experts' row offsets are read on the device, so nothing waits for the host.
// x [M, in] bf16, w [E, out, in] bf16, offsets i64 [E + 1] on x's device
// (offsets[0] = 0, non-decreasing, offsets[E] <= M): expert e's rows are
// [offsets[e], offsets[e + 1]); rows from offsets[E] on are padding. Any in,
// out, M (0 included) and E.
#pragma once

#include "backend/cuda/runtime.h"
#include "core/tensor.h"

namespace moetrain::cuda {

// y [M, out]: y_rows(e) = x_rows(e) w[e]ᵀ (f32 sums, one bf16 rounding); padding rows of y = 0.
MT_CUDA_KERNEL(void grouped_linear_forward_dev(Tensor& y, const Tensor& x, const Tensor& w, const Tensor& offsets));
// dx [M, in]: dx_rows(e) = dy_rows(e) w[e]; padding rows of dx = 0.
// dw [E, out, in]: dw[e] = dy_rows(e)ᵀ x_rows(e); an expert without rows: dw[e] = 0.
MT_CUDA_KERNEL(void grouped_linear_backward_dev(Tensor& dx, Tensor& dw, const Tensor& dy, const Tensor& x,
                                               const Tensor& w, const Tensor& offsets));

}  // namespace moetrain::cuda
