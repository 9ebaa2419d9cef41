// renormalize_rows (ops/router/route_weights.h).
#include "ops/router/route_weights.h"

#include <cmath>

#include "autograd/node.h"
#include "ops/common/checks.h"
#include "ops/common/on_device.h"
#include "ops/router/route_weights_kernels.h"

namespace moetrain {

Tensor renormalize_rows(const Tensor& w, double eps) {
  check_float("renormalize_rows", "w", w);
  MT_CHECK(w.dim() >= 1 && w.size(-1) >= 1, "renormalize_rows: w {} must have rows of at least one weight",
           w.shape());
  MT_CHECK(std::isfinite(eps) && eps >= 0, "renormalize_rows: eps must be finite and >= 0, got {}", eps);
  Tensor y = empty_like(w);
  MT_ON_DEVICE(w, renormalize_rows_forward, y, w, eps);
  return record("renormalize_rows", y, {w}, [w, eps](const Tensor& grad_y) {
    Tensor grad_w = empty_like(w);
    MT_ON_DEVICE(w, renormalize_rows_backward, grad_w, grad_y, w, eps);
    return Grads{grad_w};
  });
}

}  // namespace moetrain
