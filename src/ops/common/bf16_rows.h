// Row-wise bf16 <-> f32 for CPU kernels with a bf16 path of their own: a kernel
// widens one row (or block) of a bf16 operand into a per-thread f32 buffer, runs its
// f32 code on it and rounds its f32 result row once into the bf16 output. The bits
// are those of cpu::run_kernel's whole-tensor widening (ops/common/bf16_widen.h:
// exact widening, one rounding to nearest even), without the f32 copies of whole
// tensors (the [N, V] logits of a language model head: 200 MB at N 1024, V 50304).
#pragma once

#include <cstdint>
#include <type_traits>
#include <vector>

#include "core/dtype.h"
#include "core/tensor.h"

namespace moetrain::cpu {

// dst[i] = src[i] as f32 (exact), i < n.
inline void widen_bf16_row(float* __restrict dst, const bf16* __restrict src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = src[i].to_float();
}

// dst[i] = src[i] rounded to bf16 (nearest even; NaN stays NaN), i < n.
inline void round_bf16_row(bf16* __restrict dst, const float* __restrict src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16::from_float(src[i]);
}

// A small operand (a norm's weight) as f32: t's data when it is f32, else its values
// widened into buf (exact). Null for an undefined t.
inline const float* f32_operand(const Tensor& t, std::vector<float>& buf) {
  if (!t.defined()) return nullptr;
  if (t.dtype() == DType::f32) return t.data<float>();
  buf.resize(static_cast<size_t>(t.numel()));
  widen_bf16_row(buf.data(), t.data<bf16>(), t.numel());
  return buf.data();
}

// An element as the f32 kernel reads it: bf16 widened (exact), f32 and f64 as they are.
inline float widened_value(bf16 v) { return v.to_float(); }
inline float widened_value(float v) { return v; }
inline double widened_value(double v) { return v; }

// Stores a value the f32 kernel computes in double into an element of type T as the
// widening route does: static_cast<T> for f32 and f64; for bf16, the f32 value (the
// f32 kernel's output) rounded once to bf16.
template <class T>
inline void store_rounded(T& dst, double v) {
  if constexpr (std::is_same_v<T, bf16>)
    dst = bf16::from_float(static_cast<float>(v));
  else
    dst = static_cast<T>(v);
}

}  // namespace moetrain::cpu
