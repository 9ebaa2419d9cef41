#include "ops/topk/topk.h"

#include "autograd/node.h"
#include "ops/common/checks.h"
#include "ops/common/on_device.h"
#include "ops/topk/topk_kernels.h"

namespace moetrain {

TopK topk(const Tensor& x, int64_t k) {
  check_float("topk", "x", x);
  check_rank("topk", "x", x, -1);
  MT_CHECK(k >= 1 && k <= x.size(-1), "topk: k = {} must be in [1, {}] for x {}", k, x.size(-1), x.shape());
  Shape out_shape = x.shape().with(-1, k);
  Tensor values = empty(out_shape, x.dtype(), x.device());
  Tensor indices = empty(out_shape, DType::i64, x.device());
  MT_ON_DEVICE(x, topk_forward, values, indices, x, k);
  Shape in_shape = x.shape();
  values = record("topk", values, {x}, [in_shape, indices](const Tensor& g) {
    Tensor grad_x = empty(in_shape, g.dtype(), g.device());
    MT_ON_DEVICE(g, topk_backward, grad_x, g, indices);
    return Grads{grad_x};
  });
  return {values, indices};
}

}  // namespace moetrain
