// Run-time dtype -> compile-time type dispatch for kernels.
//   dispatch_float(t.dtype(), "rms_norm", [&](auto tag) { using T = decltype(tag); ... });
#pragma once

#include <cstdint>

#include "core/dtype.h"
#include "core/error.h"

namespace moetrain {

// f32 and f64 (the compute types of the CPU kernels).
template <class F>
decltype(auto) dispatch_float(DType t, const char* op, F&& f) {
  switch (t) {
    case DType::f32: return f(float{});
    case DType::f64: return f(double{});
    default: MT_THROW("{}: expected a floating tensor (f32 or f64), got {}", op, t);
  }
}

// f32, f64 and bf16: the CPU kernels with a bf16 path of their own (bf16 values read
// widened, results rounded once; ops/common/bf16_rows.h).
template <class F>
decltype(auto) dispatch_float_or_bf16(DType t, const char* op, F&& f) {
  if (t == DType::bf16) return f(bf16{});
  return dispatch_float(t, op, static_cast<F&&>(f));
}

// i32 and i64 (index tensors).
template <class F>
decltype(auto) dispatch_index(DType t, const char* op, F&& f) {
  switch (t) {
    case DType::i32: return f(int32_t{});
    case DType::i64: return f(int64_t{});
    default: MT_THROW("{}: expected an index tensor (i32 or i64), got {}", op, t);
  }
}

// Every dtype.
template <class F>
decltype(auto) dispatch_all(DType t, F&& f) {
  switch (t) {
    case DType::f32: return f(float{});
    case DType::f64: return f(double{});
    case DType::bf16: return f(bf16{});
    case DType::i32: return f(int32_t{});
    case DType::i64: return f(int64_t{});
    case DType::u16: return f(uint16_t{});
  }
  MT_THROW("unknown dtype {}", static_cast<int>(t));
}

template <class T> inline double to_double(T v) { return static_cast<double>(v); }
template <> inline double to_double<bf16>(bf16 v) { return v.to_float(); }
template <class T> inline T from_double(double v) { return static_cast<T>(v); }
template <> inline bf16 from_double<bf16>(double v) { return bf16::from_float(static_cast<float>(v)); }

}  // namespace moetrain
