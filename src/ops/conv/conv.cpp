#include "ops/conv/conv.h"

#include "autograd/node.h"
#include "ops/common/checks.h"
#include "ops/common/on_device.h"
#include "ops/conv/conv_kernels.h"
#include "ops/conv/conv_silu.h"

namespace moetrain {

namespace {

// causal_conv1d, with silu (conv_silu.h) the SiLU fused into its kernels.
Tensor causal_conv1d_op(const Tensor& x, const Tensor& weight, bool silu) {
  const char* op = silu ? "causal_conv1d_silu" : "causal_conv1d";
  check_float(op, "x", x);
  check_float(op, "weight", weight);
  // With silu, bf16 x under an f32 weight: the cast to f32 is fused too (conv_silu.h).
  if (!(silu && x.dtype() == DType::bf16 && weight.dtype() == DType::f32)) check_same_kind(op, x, weight);
  MT_CHECK(x.device() == weight.device(), "{}: x on {} but weight on {}", op, x.device(), weight.device());
  check_rank(op, "x", x, 3);
  check_rank(op, "weight", weight, 2);
  MT_CHECK(weight.size(0) == x.size(2) && weight.size(1) >= 1,
           "{}: weight {} must be [C, W] with C = {} channels of x {}", op, weight.shape(), x.size(2), x.shape());
  Tensor y = empty(x.shape(), weight.dtype(), x.device());  // the weight's dtype
  MT_ON_DEVICE(x, causal_conv1d_forward, y, x, weight, silu);
  return record(op, y, {x, weight}, [x, weight, silu](const Tensor& grad_y) {
    Tensor grad_x, grad_w;
    if (x.requires_grad()) grad_x = empty_like(x);
    if (weight.requires_grad()) grad_w = empty_like(weight);
    Tensor* gx = grad_x.defined() ? &grad_x : nullptr;
    Tensor* gw = grad_w.defined() ? &grad_w : nullptr;
    MT_ON_DEVICE(x, causal_conv1d_backward, gx, gw, grad_y, x, weight, silu);
    return Grads{grad_x, grad_w};
  });
}

}  // namespace

Tensor causal_conv1d(const Tensor& x, const Tensor& weight) { return causal_conv1d_op(x, weight, false); }

Tensor causal_conv1d_silu(const Tensor& x, const Tensor& weight) { return causal_conv1d_op(x, weight, true); }

}  // namespace moetrain
