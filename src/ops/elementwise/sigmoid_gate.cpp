// sigmoid_gate (ops/elementwise/sigmoid_gate.h).
#include "ops/elementwise/sigmoid_gate.h"

#include "autograd/node.h"
#include "ops/common/checks.h"
#include "ops/common/on_device.h"
#include "ops/elementwise/elementwise_kernels.h"

namespace moetrain {

Tensor sigmoid_gate(const Tensor& x, const Tensor& z) {
  check_float("sigmoid_gate", "x", x);
  check_float("sigmoid_gate", "z", z);
  check_same_kind("sigmoid_gate", x, z);
  MT_CHECK(x.shape() == z.shape(), "sigmoid_gate: x is {} but the gate z is {}; they must have the same shape",
           x.shape(), z.shape());
  Tensor y = empty_like(x);
  MT_ON_DEVICE(x, sigmoid_gate_forward, y, x, z);
  return record("sigmoid_gate", y, {x, z}, [x, z](const Tensor& grad_y) {
    Tensor grad_x, grad_z;
    if (x.requires_grad()) grad_x = empty_like(x);
    if (z.requires_grad()) grad_z = empty_like(z);
    Tensor* gx = grad_x.defined() ? &grad_x : nullptr;
    Tensor* gz = grad_z.defined() ? &grad_z : nullptr;
    if (gx || gz) MT_ON_DEVICE(x, sigmoid_gate_backward, gx, gz, grad_y, x, z);
    return Grads{grad_x, grad_z};
  });
}

}  // namespace moetrain
