// GPT-2's GELU, the tanh form, for the CPU kernels: 0.5 x (1 + tanh(c (x + a x^3))),
// c = sqrt(2/pi), a = 0.044715 (docs/model.md, GPT-2), and its derivative
// 0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 a x^2). One definition for the
// elementwise gelu_tanh and the linear family's fused bias + GELU passes, so the
// two give the same bits.
#pragma once

#include "ops/common/math.h"

namespace moetrain::cpu {

template <class T> inline constexpr T kGeluC = T(0.7978845608028654);  // sqrt(2/pi)
template <class T> inline constexpr T kGeluA = T(0.044715);

template <class T>
inline T gelu_tanh_of(T x) {
  T u = kGeluC<T> * (x + kGeluA<T> * x * x * x);
  return T(0.5) * x * (T(1) + tanh_of(u));
}

template <class T>
inline T gelu_tanh_derivative_of(T x) {
  T u = kGeluC<T> * (x + kGeluA<T> * x * x * x);
  T t = tanh_of(u);
  return T(0.5) * (T(1) + t) + T(0.5) * x * (T(1) - t * t) * kGeluC<T> * (T(1) + T(3) * kGeluA<T> * x * x);
}

}  // namespace moetrain::cpu
