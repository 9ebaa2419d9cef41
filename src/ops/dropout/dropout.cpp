#include "ops/dropout/dropout.h"

#include "autograd/node.h"
#include "core/graph_capture.h"
#include "ops/common/checks.h"
#include "ops/common/on_device.h"
#include "ops/dropout/dropout_kernels.h"

namespace moetrain {

Tensor dropout(const Tensor& x, double p, Generator* gen) {
  check_float("dropout", "x", x);
  MT_CHECK(p >= 0.0 && p < 1.0, "dropout: p = {} must be in [0, 1)", p);
  if (p == 0.0) return x;
  // The draw's offset is a host number baked into the kernels: a CUDA graph would
  // replay the same mask every step.
  graph::refuse_if_capturing("dropout's random draw");
  Generator& g = gen ? *gen : default_generator();
  uint64_t first = g.reserve(static_cast<uint64_t>(x.numel()));
  Generator mask_gen = g;  // seed is what matters; offsets are passed explicitly
  Tensor y = empty_like(x);
  MT_ON_DEVICE(x, dropout_apply, y, x, p, mask_gen, first);
  return record("dropout", y, {x}, [p, mask_gen, first](const Tensor& grad_y) {
    Tensor grad_x = empty_like(grad_y);
    MT_ON_DEVICE(grad_y, dropout_apply, grad_x, grad_y, p, mask_gen, first);
    return Grads{grad_x};
  });
}

}  // namespace moetrain
