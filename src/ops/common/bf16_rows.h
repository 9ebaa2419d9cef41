// Row-wise bf16 <-> f32 for CPU kernels with a bf16 path of their own: a kernel
// widens one row (or block) of a bf16 operand into a per-thread f32 buffer, runs its
// f32 code on it and rounds its f32 result row once into the bf16 output. The bits
// are those of cpu::run_kernel's whole-tensor widening (ops/common/bf16_widen.h:
// exact widening, one rounding to nearest even), without the f32 copies of whole
// tensors (the [N, V] logits of a language model head: 200 MB at N 1024, V 50304).
#pragma once

#include <cstdint>

#include "core/dtype.h"

namespace moetrain::cpu {

// dst[i] = src[i] as f32 (exact), i < n.
inline void widen_bf16_row(float* __restrict dst, const bf16* __restrict src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i].to_float();
}

// dst[i] = src[i] rounded to bf16 (nearest even; NaN stays NaN), i < n.
inline void round_bf16_row(bf16* __restrict dst, const float* __restrict src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16::from_float(src[i]);
}

}  // namespace moetrain::cpu
