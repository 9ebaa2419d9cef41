#include "ops/conv/conv.h"

#include "autograd/node.h"
#include "ops/common/checks.h"
#include "ops/common/on_device.h"
#include "ops/conv/conv_kernels.h"

namespace moetrain {

Tensor causal_conv1d(const Tensor& x, const Tensor& weight) {
  check_float("causal_conv1d", "x", x);
  check_float("causal_conv1d", "weight", weight);
  check_same_kind("causal_conv1d", x, weight);
  check_rank("causal_conv1d", "x", x, 3);
  check_rank("causal_conv1d", "weight", weight, 2);
  MT_CHECK(weight.size(0) == x.size(2) && weight.size(1) >= 1,
           "causal_conv1d: weight {} must be [C, W] with C = {} channels of x {}", weight.shape(), x.size(2),
           x.shape());
  Tensor y = empty_like(x);
  MT_ON_DEVICE(x, causal_conv1d_forward, y, x, weight);
  return record("causal_conv1d", y, {x, weight}, [x, weight](const Tensor& grad_y) {
    Tensor grad_x, grad_w;
    if (x.requires_grad()) grad_x = empty_like(x);
    if (weight.requires_grad()) grad_w = empty_like(weight);
    Tensor* gx = grad_x.defined() ? &grad_x : nullptr;
    Tensor* gw = grad_w.defined() ? &grad_w : nullptr;
    MT_ON_DEVICE(x, causal_conv1d_backward, gx, gw, grad_y, x, weight);
    return Grads{grad_x, grad_w};
  });
}

}  // namespace moetrain
