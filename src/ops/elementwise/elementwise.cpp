// Elementwise ops and their backward (derivatives noted per op).
#include "ops/elementwise/elementwise.h"

#include <cmath>

#include "autograd/node.h"
#include "core/grad_mode.h"
#include "ops/common/checks.h"
#include "ops/common/on_device.h"
#include "ops/elementwise/elementwise_kernels.h"

namespace moetrain {

Shape broadcast_shape(const Shape& a, const Shape& b, const char* op) {
  int nd = std::max(a.ndim(), b.ndim());
  std::vector<int64_t> out(static_cast<size_t>(nd));
  for (int i = 0; i < nd; ++i) {
    int ia = a.ndim() - nd + i, ib = b.ndim() - nd + i;
    int64_t da = ia >= 0 ? a[ia] : 1, db = ib >= 0 ? b[ib] : 1;
    MT_CHECK(da == db || da == 1 || db == 1, "{}: shapes {} and {} do not broadcast (dim {}: {} vs {})", op, a, b,
             i - nd, da, db);
    out[static_cast<size_t>(i)] = da == 1 ? db : da;
  }
  return Shape(out);
}

namespace {

Tensor binary(BinaryOp op, const char* name, const Tensor& a, const Tensor& b) {
  check_float(name, "a", a);
  check_float(name, "b", b);
  check_same_kind(name, a, b);
  Tensor out = empty(broadcast_shape(a.shape(), b.shape(), name), a.dtype(), a.device());
  MT_ON_DEVICE(out, binary_forward, op, out, a, b);
  return out;
}

Tensor reduce_grad(const Tensor& g, const Tensor& like) {
  return g.shape() == like.shape() ? g : sum_to(g, like.shape());
}

Tensor unary(UnaryOp op, const char* name, const Tensor& x) {
  check_float(name, "x", x);
  Tensor y = empty_like(x);
  MT_ON_DEVICE(x, unary_forward, op, y, x);
  Tensor y_saved = y.detach();
  return record(name, y, {x}, [op, x, y_saved](const Tensor& grad_y) {
    Tensor grad_x = empty_like(x);
    MT_ON_DEVICE(x, unary_backward, op, grad_x, grad_y, x, y_saved);
    return Grads{grad_x};
  });
}

}  // namespace

Tensor add(const Tensor& a, const Tensor& b) {
  Tensor out = binary(BinaryOp::add, "add", a, b);
  return record("add", out, {a, b}, [a, b](const Tensor& g) {
    return Grads{reduce_grad(g, a), reduce_grad(g, b)};
  });
}

Tensor sub(const Tensor& a, const Tensor& b) {
  Tensor out = binary(BinaryOp::sub, "sub", a, b);
  return record("sub", out, {a, b}, [a, b](const Tensor& g) {
    return Grads{reduce_grad(g, a), reduce_grad(neg(g), b)};
  });
}

// d(ab) = b da + a db
Tensor mul(const Tensor& a, const Tensor& b) {
  Tensor out = binary(BinaryOp::mul, "mul", a, b);
  return record("mul", out, {a, b}, [a, b](const Tensor& g) {
    return Grads{a.requires_grad() ? reduce_grad(mul(g, b), a) : Tensor(),
                 b.requires_grad() ? reduce_grad(mul(g, a), b) : Tensor()};
  });
}

// d(a/b) = da / b - (a/b) db / b
Tensor div(const Tensor& a, const Tensor& b) {
  Tensor out = binary(BinaryOp::div, "div", a, b);
  Tensor out_saved = out.detach();
  return record("div", out, {a, b}, [a, b, out_saved](const Tensor& g) {
    Tensor g_over_b = div(g, b);
    return Grads{a.requires_grad() ? reduce_grad(g_over_b, a) : Tensor(),
                 b.requires_grad() ? reduce_grad(neg(mul(g_over_b, out_saved)), b) : Tensor()};
  });
}

Tensor maximum(const Tensor& a, const Tensor& b) { return binary(BinaryOp::max, "maximum", a, b); }  // not recorded

Tensor add_scalar(const Tensor& x, double s) {
  check_float("add_scalar", "x", x);
  Tensor y = empty_like(x);
  MT_ON_DEVICE(x, affine_forward, y, x, 1.0, s);
  return record("add_scalar", y, {x}, [](const Tensor& g) { return Grads{g}; });
}

Tensor mul_scalar(const Tensor& x, double s) {
  check_float("mul_scalar", "x", x);
  Tensor y = empty_like(x);
  MT_ON_DEVICE(x, affine_forward, y, x, s, 0.0);
  return record("mul_scalar", y, {x}, [s](const Tensor& g) { return Grads{mul_scalar(g, s)}; });
}

// d(x^p) = p x^(p-1) dx
Tensor pow_scalar(const Tensor& x, double p) {
  check_float("pow_scalar", "x", x);
  Tensor y = empty_like(x);
  MT_ON_DEVICE(x, pow_forward, y, x, p);
  return record("pow_scalar", y, {x}, [x, p](const Tensor& g) {
    return Grads{mul(g, mul_scalar(pow_scalar(x, p - 1.0), p))};
  });
}

Tensor neg(const Tensor& x) { return unary(UnaryOp::neg, "neg", x); }
Tensor exp(const Tensor& x) { return unary(UnaryOp::exp, "exp", x); }
Tensor log(const Tensor& x) { return unary(UnaryOp::log, "log", x); }
Tensor sqrt(const Tensor& x) { return unary(UnaryOp::sqrt, "sqrt", x); }
Tensor square(const Tensor& x) { return unary(UnaryOp::square, "square", x); }
Tensor tanh(const Tensor& x) { return unary(UnaryOp::tanh, "tanh", x); }
Tensor sigmoid(const Tensor& x) { return unary(UnaryOp::sigmoid, "sigmoid", x); }
Tensor relu(const Tensor& x) { return unary(UnaryOp::relu, "relu", x); }
Tensor silu(const Tensor& x) { return unary(UnaryOp::silu, "silu", x); }
Tensor softplus(const Tensor& x) { return unary(UnaryOp::softplus, "softplus", x); }
Tensor gelu_tanh(const Tensor& x) { return unary(UnaryOp::gelu_tanh, "gelu_tanh", x); }

Tensor sum_to(const Tensor& t, const Shape& shape) {
  check_float("sum_to", "t", t);
  MT_CHECK(broadcast_shape(shape, t.shape(), "sum_to") == t.shape(),
           "sum_to: {} cannot be summed to {} ({} must broadcast to the tensor's shape)", t.shape(), shape, shape);
  if (shape == t.shape()) return t;
  Tensor out = empty(shape, t.dtype(), t.device());
  MT_ON_DEVICE(t, sum_to, out, t);
  Shape in_shape = t.shape();
  return record("sum_to", out, {t}, [in_shape](const Tensor& g) { return Grads{broadcast_to(g, in_shape)}; });
}

Tensor broadcast_to(const Tensor& x, const Shape& shape) {
  check_float("broadcast_to", "x", x);
  MT_CHECK(broadcast_shape(x.shape(), shape, "broadcast_to") == shape, "broadcast_to: {} does not broadcast to {}",
           x.shape(), shape);
  if (x.shape() == shape) return x;
  Tensor y = empty(shape, x.dtype(), x.device());
  MT_ON_DEVICE(x, broadcast_copy, y, x);
  Shape in_shape = x.shape();
  return record("broadcast_to", y, {x}, [in_shape](const Tensor& g) { return Grads{sum_to(g, in_shape)}; });
}

void add_(const Tensor& dst, const Tensor& src, double alpha) {
  check_float("add_", "dst", dst);
  check_same_kind("add_", dst, src);
  MT_CHECK(!(dst.requires_grad() && autograd::grad_enabled()),
           "add_: in-place update of {} which requires grad while grad mode is on; use NoGradGuard", describe(dst));
  MT_CHECK(dst.shape() == src.shape(), "add_: destination {} but source {}", describe(dst), describe(src));
  Tensor d = dst;
  MT_ON_DEVICE(d, add_inplace, d, src, alpha);
}

}  // namespace moetrain
