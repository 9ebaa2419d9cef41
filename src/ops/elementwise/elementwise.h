// Elementwise ops: binary with NumPy broadcasting, unary activations, scalar ops.
// No type promotion: both operands of a binary op have the same dtype.
// Gradients of broadcast operands are summed back to the operand's shape.
#pragma once

#include "core/tensor.h"

namespace moetrain {

// Shape of broadcasting a and b (trailing dims aligned, 1 stretches); throws
// moetrain::Error naming `op` and both shapes when they do not broadcast.
Shape broadcast_shape(const Shape& a, const Shape& b, const char* op);

Tensor add(const Tensor& a, const Tensor& b);
Tensor sub(const Tensor& a, const Tensor& b);
Tensor mul(const Tensor& a, const Tensor& b);
Tensor div(const Tensor& a, const Tensor& b);
// Elementwise max(a, b) with broadcasting; a NaN in either operand gives NaN. No
// gradient (statistics: QK-Clip's running max logit, docs/model.md#qk-clip).
Tensor maximum(const Tensor& a, const Tensor& b);

Tensor add_scalar(const Tensor& x, double s);
Tensor mul_scalar(const Tensor& x, double s);
Tensor pow_scalar(const Tensor& x, double p);  // x^p; x > 0 unless p is an integer

Tensor neg(const Tensor& x);
Tensor exp(const Tensor& x);
Tensor log(const Tensor& x);
Tensor sqrt(const Tensor& x);
Tensor square(const Tensor& x);
Tensor tanh(const Tensor& x);
Tensor sigmoid(const Tensor& x);
Tensor relu(const Tensor& x);
Tensor silu(const Tensor& x);      // x sigmoid(x)
Tensor softplus(const Tensor& x);  // log(1 + e^x), overflow-safe
Tensor gelu_tanh(const Tensor& x); // 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), GPT-2's gelu

// x broadcast to `shape` (a copy); backward sums back with sum_to.
Tensor broadcast_to(const Tensor& x, const Shape& shape);

// Sums t over the dims that broadcasting stretched, giving `shape`
// (the backward of broadcasting; also an op of its own).
Tensor sum_to(const Tensor& t, const Shape& shape);

// dst += src (same shape and dtype), in place and not recorded: gradient
// buffers and optimizer state only.
void add_(const Tensor& dst, const Tensor& src, double alpha = 1.0);

inline Tensor operator+(const Tensor& a, const Tensor& b) { return add(a, b); }
inline Tensor operator-(const Tensor& a, const Tensor& b) { return sub(a, b); }
inline Tensor operator*(const Tensor& a, const Tensor& b) { return mul(a, b); }
inline Tensor operator/(const Tensor& a, const Tensor& b) { return div(a, b); }
inline Tensor operator-(const Tensor& a) { return neg(a); }
inline Tensor operator+(const Tensor& a, double s) { return add_scalar(a, s); }
inline Tensor operator-(const Tensor& a, double s) { return add_scalar(a, -s); }
inline Tensor operator*(const Tensor& a, double s) { return mul_scalar(a, s); }
inline Tensor operator*(double s, const Tensor& a) { return mul_scalar(a, s); }
inline Tensor operator/(const Tensor& a, double s) { return mul_scalar(a, 1.0 / s); }

}  // namespace moetrain
